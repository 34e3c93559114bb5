"""Perplexity and KL divergence (`qinfer.analysis.perplexity`), as llama-perplexity measures them,
against transformers' fp32 logits on a random checkpoint."""

import math

import pytest
import torch
from checkpoints import HYBRID, load_pair, random_model, random_tokens, reference_logits

from qinfer.analysis.perplexity import perplexity
from qinfer.core.errors import QinferError

CONTEXT = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_pair(tmp_path_factory.mktemp("qwen3"), "qwen3")


def test_perplexity_scores_the_second_half_of_each_chunk_like_llama_perplexity(pair):
    reference, model = pair
    ids = random_tokens(1, 3 * CONTEXT + 5)[0].tolist()  # 3 chunks; the 5 left over unscored
    nll, scored = 0.0, 0
    for c in range(3):
        chunk = torch.tensor([ids[c * CONTEXT : (c + 1) * CONTEXT]])
        log_probs = torch.log_softmax(reference_logits(reference, chunk)[0], -1)
        for i in range(CONTEXT // 2, CONTEXT - 1):  # position i predicts token i + 1
            nll -= log_probs[i, chunk[0, i + 1]].item()
            scored += 1
    result = perplexity(model, ids, CONTEXT)
    assert (result.chunks, result.scored) == (3, scored)
    assert result.nll == pytest.approx(nll / scored, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nll / scored), rel=1e-5)
    assert result.kl is None


def test_a_model_against_itself_diverges_by_nothing(pair):
    _, model = pair
    ids = random_tokens(1, 2 * CONTEXT, seed=3)[0].tolist()
    result = perplexity(model, ids, CONTEXT, base=model)
    assert abs(result.kl) < 1e-6 and result.kl_max < 1e-5 and result.top1 == 1.0


def test_kl_is_the_divergence_of_the_models_distribution_from_the_base(pair):
    reference, model = pair
    other = random_model("qwen3", seed=5)  # another random model, same shapes
    ids = random_tokens(1, CONTEXT, seed=4)[0].tolist()
    chunk = torch.tensor([ids])
    p = torch.log_softmax(reference_logits(reference, chunk)[0, CONTEXT // 2 : -1], -1)
    with torch.no_grad():
        q = torch.log_softmax(other(chunk)[0, CONTEXT // 2 : -1], -1)
    per_token = (p.exp() * (p - q)).sum(-1)
    result = perplexity(other, ids, CONTEXT, base=model)
    assert result.kl == pytest.approx(per_token.mean().item(), rel=1e-4)
    assert result.kl_max == pytest.approx(per_token.max().item(), rel=1e-4)
    assert result.top1 == (p.argmax(-1) == q.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_hybrid_model_is_scored_from_its_own_recurrent_state(family):
    # Linear-attention layers read their sequence's state from the forward's cache; the
    # scorer's forward gives them one, as the model's own call does.
    model = random_model(family, **HYBRID[family])
    ids = random_tokens(1, 2 * CONTEXT, seed=6)[0].tolist()
    nll, scored = 0.0, 0
    for c in range(2):
        chunk = torch.tensor([ids[c * CONTEXT : (c + 1) * CONTEXT]])
        log_probs = torch.log_softmax(model(chunk)[0], -1)
        for i in range(CONTEXT // 2, CONTEXT - 1):
            nll -= log_probs[i, chunk[0, i + 1]].item()
            scored += 1
    result = perplexity(model, ids, CONTEXT)
    assert result.scored == scored
    assert result.nll == pytest.approx(nll / scored, rel=1e-5)


@pytest.mark.parametrize(
    ("ids", "context", "says"),
    [
        (list(range(10)), 16, "shorter than one chunk of 16"),
        (list(range(40)), 15, "even number"),
        (list(range(40)), 1 << 20, "longer than the model's"),
        ([1, 2, 999] + list(range(40)), 16, "token id 999 is outside the vocabulary"),
    ],
)
def test_bad_inputs_are_named(pair, ids, context, says):
    _, model = pair
    with pytest.raises(QinferError, match=says):
        perplexity(model, ids, context)


def test_the_command_prints_what_the_function_measures(qwen3_chat_folder, tmp_path, capsys):
    from qinfer import load_model, load_tokenizer
    from qinfer.cli import main

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog; " * 20)
    folder = str(qwen3_chat_folder)
    flags = ["--model", folder, "--dtype", "float32", "--context", str(CONTEXT)]
    assert main(["perplexity", str(text), *flags, "--kl-divergence-base", folder]) == 0
    out = capsys.readouterr().out
    model = load_model(folder, dtype="float32", device="cpu")
    ids = load_tokenizer(folder).encode(text.read_text())
    want = perplexity(model, ids, CONTEXT)
    assert f"perplexity {want.perplexity:.4f}" in out
    assert "mean 0.000000" in out and "top-1 agreement 100.0000%" in out


def test_the_command_refuses_a_missing_text_file_before_loading(capsys):
    from qinfer.cli import main

    assert main(["perplexity", "no-such-file.txt"]) == 2
    assert (
        capsys.readouterr().err.strip() == "qinfer: error: text_file no-such-file.txt is not a file"
    )
