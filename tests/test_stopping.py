"""The rule that ends a request, shared by qinfer.generate and the batching engine."""

import pytest
from checkpoints import build_tokenizer

from qinfer import SamplingParams, load_tokenizer
from qinfer.request.stopping import accept_token
from qinfer.text.detokenizer import IncrementalDetokenizer

EOS = frozenset({7})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder)
    return load_tokenizer(folder)


def feed(tokenizer, params, text, max_tokens=100):
    """Push `text` token by token; return the steps."""
    detokenizer = IncrementalDetokenizer(tokenizer, params.stop)
    ids = tokenizer.encode(text, add_special_tokens=False)
    steps = []
    for n, token in enumerate(ids, start=1):
        steps.append(accept_token(token, params, EOS, detokenizer, n, max_tokens))
        if steps[-1].finish_reason:
            break
    return steps


def test_stop_token_id_wins_over_eos_and_names_itself():
    step = accept_token(7, SamplingParams(stop_token_ids=[7]), EOS, None, 1, 10)
    assert (step.finish_reason, step.stop_reason, step.text) == ("stop", 7, "")


def test_eos_ends_unless_ignored():
    assert accept_token(7, SamplingParams(), EOS, None, 1, 10).finish_reason == "eos"
    assert accept_token(7, SamplingParams(ignore_eos=True), EOS, None, 1, 10).finish_reason is None


def test_length_ends_at_the_budget_and_flushes_held_text(tokenizer):
    params = SamplingParams(stop=["xyz"])
    steps = feed(tokenizer, params, "abcx", max_tokens=4)
    assert [s.finish_reason for s in steps] == [None, None, None, "length"]
    # "x" may start the stop string, so it is held back until the request ends.
    assert "".join(s.text for s in steps) == "abcx"


def test_stop_string_across_tokens_is_trimmed(tokenizer):
    steps = feed(tokenizer, SamplingParams(stop=["cd"]), "abcdef")
    assert steps[-1].finish_reason == "stop" and steps[-1].stop_reason == "cd"
    assert "".join(s.text for s in steps) == "ab"


def test_eos_flushes_what_the_detokenizer_held(tokenizer):
    params = SamplingParams(stop=["xyz"])
    detokenizer = IncrementalDetokenizer(tokenizer, params.stop)
    ids = tokenizer.encode("ax", add_special_tokens=False)
    texts = [accept_token(t, params, EOS, detokenizer, n, 10).text for n, t in enumerate(ids, 1)]
    step = accept_token(7, params, EOS, detokenizer, 3, 10)
    assert step.finish_reason == "eos"
    assert "".join(texts) + step.text == "ax"
