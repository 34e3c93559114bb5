"""Speculative decoding (`qinfer.engine.speculative`): proposals change the speed, never the output.

Greedy output with speculation on is token for token the output with it off, for every
family and with every engine feature that touches the tokens a step runs (prefix cache,
preemption, chunked prefill, grammars, stop strings, max_tokens, tensor parallelism).
Sampled output keeps the target's distribution: rejection sampling is checked on its own
and through the engine against the exact distribution of a tiny model.
"""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import httpx
import pytest
import torch
from checkpoints import build_chat_checkpoint, build_checkpoint
from servers import metric_values, serving

import qinfer
from qinfer.cli import main
from qinfer.core.errors import QinferError
from qinfer.engine import LLM
from qinfer.engine.sequence import Sequence
from qinfer.engine.speculative.draft import DraftModel
from qinfer.engine.speculative.ngram import propose_ngram
from qinfer.request.sampling import SamplingParams, process_logits, sample

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
FAMILIES = ["qwen3", "qwen3_moe", "qwen2", "llama", "mistral", "gemma3", "smollm3", "phi3"]


def copying_prompts(seed: int = 0, count: int = 4) -> list[list[int]]:
    """Prompts that repeat a run of tokens (prompt lookup finds matches in them), of
    different lengths."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        run = [rng.randrange(3, 250) for _ in range(rng.randint(4, 12))]
        prompts.append(run * rng.randint(2, 3) + [rng.randrange(3, 250)])
    return prompts


def generate(model, prompts, params, **engine_args):
    """(token ids per prompt, the engine's stats) of one LLM run."""
    llm = LLM(model, **engine_args)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0, stats
    return [o.token_ids for o in outputs], stats


def assert_same_as_without(model, prompts, params, speculative, **engine_args):
    """Speculation changes nothing in the tokens, and it did propose and keep some."""
    want, _ = generate(model, prompts, params, **engine_args)
    got, stats = generate(model, prompts, params, speculative=speculative, **engine_args)
    assert got == want
    assert stats.spec_accepted_tokens_total > 0, stats
    return stats


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec-qwen3")
    build_checkpoint(folder, "qwen3")
    return folder


@pytest.fixture(scope="module")
def model(qwen3):
    return qinfer.load_model(qwen3, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def int8_draft(qwen3):
    """The target's own checkpoint with int8 weights: a draft that mostly agrees."""
    return qinfer.load_model(qwen3, dtype=torch.float32, device="cpu", quantize="int8")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_prompt_lookup_and_draft_give_the_same_tokens_in_every_family(family, tmp_path):
    build_checkpoint(tmp_path, family)
    target = qinfer.load_model(tmp_path, dtype=torch.float32, device="cpu")
    prompts = copying_prompts()
    assert_same_as_without(target, prompts, GREEDY, {"method": "ngram"})
    draft = qinfer.load_model(tmp_path, dtype=torch.float32, device="cpu", quantize="int8")
    assert_same_as_without(target, prompts, GREEDY, {"method": "draft", "model": draft})


def test_a_draft_checkpoint_path_is_loaded_on_the_targets_device(model, qwen3):
    settings = {"method": "draft", "model": str(qwen3), "num_speculative_tokens": 3}
    stats = assert_same_as_without(model, copying_prompts(1), GREEDY, settings)
    # the same weights: every proposal is kept
    assert stats.spec_accepted_tokens_total == stats.spec_proposed_tokens_total


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_prefix_caching=True, block_size=4, max_num_seqs=4),
        dict(num_kv_blocks=10, block_size=4),  # preemption
        dict(max_num_batched_tokens=8, max_num_seqs=4),  # chunked prefill, split proposals
    ],
    ids=["prefix-cache", "preemption", "chunked-prefill"],
)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identity_holds_with_engine_features(model, int8_draft, engine_args, method):
    prompts = copying_prompts(2, count=6)
    prompts += [p[:-1] + [7] for p in prompts[:3]]  # shared prefixes: prefix-cache hits
    settings = (
        {"method": "ngram"} if method == "ngram" else {"method": "draft", "model": int8_draft}
    )
    stats = assert_same_as_without(model, prompts, GREEDY, settings, **engine_args)
    if "num_kv_blocks" in engine_args:
        assert stats.preemptions_total > 0
    if engine_args.get("enable_prefix_caching"):
        assert stats.prefix_cache_hits > 0


def test_penalties_see_each_accepted_token_before_the_next_row(model, int8_draft):
    """With penalties each row's distribution depends on the tokens kept before it: rows
    are sampled one after another, and the output is still the one without speculation."""
    params = GREEDY.replace(repetition_penalty=1.3, presence_penalty=0.5)
    draft = {"method": "draft", "model": int8_draft}
    assert_same_as_without(model, copying_prompts(8), params, draft)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9])
def test_max_tokens_is_never_exceeded(model, max_tokens):
    params = GREEDY.replace(max_tokens=max_tokens)
    want, _ = generate(model, copying_prompts(3), params)
    got, _ = generate(model, copying_prompts(3), params, speculative={"method": "ngram"})
    assert got == want and all(len(ids) == max_tokens for ids in got)


def test_logprobs_of_accepted_tokens_are_those_without_speculation(model):
    params = GREEDY.replace(logprobs=3)
    prompts = copying_prompts(4)
    plain = LLM(model).generate(prompts, params, use_tqdm=False)
    spec = LLM(model, speculative={"method": "ngram"}).generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec, strict=True):
        assert [t.token_id for t in a.logprobs] == [t.token_id for t in b.logprobs]
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) < 1e-4
            assert x.top_logprobs.keys() == y.top_logprobs.keys()


@pytest.fixture(scope="module")
def chat_llms(qwen3_chat_folder):
    model = qinfer.load_model(qwen3_chat_folder, dtype=torch.float32, device="cpu")
    tokenizer = qinfer.load_tokenizer(qwen3_chat_folder)
    # The model drafts for itself: every proposal it makes unconstrained is kept, so stop
    # strings and grammars meet long accepted runs.
    spec = LLM(model, tokenizer, speculative={"method": "draft", "model": model})
    return LLM(model, tokenizer), spec


def test_a_stop_string_inside_an_accepted_run_ends_the_request_there(chat_llms):
    plain, spec = chat_llms
    prompt = "abcabcabcabcabc" * 3
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    free = plain.generate([prompt], params, use_tqdm=False)[0]
    text = free.text
    assert len(text) > 12, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # lands mid-output
    stopped = params.replace(stop=(stop,))
    want = plain.generate([prompt], stopped, use_tqdm=False)[0]
    got = spec.generate([prompt], stopped, use_tqdm=False)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (
        want.text,
        want.token_ids,
        want.finish_reason,
    )
    assert got.finish_reason == "stop" and len(got.text) < len(text)
    assert spec.engine.stats().spec_accepted_tokens_total > 0


def test_a_grammar_constrained_request_gives_the_same_output(chat_llms):
    plain, spec = chat_llms
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    params = SamplingParams(temperature=0.0, max_tokens=48, json_schema=schema)
    prompts = ['{"a": "xyzxyzxyzxyz"}' * 3]
    want = plain.generate(prompts, params, use_tqdm=False)[0]
    got = spec.generate(prompts, params, use_tqdm=False)[0]
    assert (got.text, got.token_ids) == (want.text, want.token_ids)


def test_seeded_sampling_with_speculation_reproduces(model):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    first, _ = generate(model, copying_prompts(5), params, speculative={"method": "ngram"})
    again, _ = generate(model, copying_prompts(5), params, speculative={"method": "ngram"})
    assert first == again


# -- the distribution ---------------------------------------------------------------------


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    """Pearson's statistic over the cells expected at least 5 times (the rest pooled into
    one cell), and its degrees of freedom."""
    n = sum(counts)
    cells, rest_count, rest_prob = [], 0, 0.0
    for c, p in zip(counts, probs, strict=True):
        if n * p >= 5:
            cells.append((c, p))
        else:
            rest_count, rest_prob = rest_count + c, rest_prob + p
    if rest_prob > 0:
        cells.append((rest_count, rest_prob))
    return sum((c - n * p) ** 2 / (n * p) for c, p in cells), len(cells) - 1


#: Chi-square quantiles at 1 - 1e-4 (the draws are seeded, so each test is deterministic;
#: a wrong distribution misses these by orders of magnitude at these sample sizes).
CHI2_LIMIT = {5: 25.7, 6: 27.9, 7: 29.9}


@pytest.mark.parametrize("proposal", [0, 3, 5], ids=["likely", "unlikely", "outside-top-k"])
def test_rejection_sampling_keeps_the_distribution(proposal):
    """One row, many draws: with a proposal kept by rejection, the tokens still follow
    softmax(process_logits(logits)), whatever the proposal's own probability."""
    logits = torch.tensor([[2.0, 1.5, 0.5, 0.0, -0.5, -3.0, -1.0, 1.0]])
    params = SamplingParams(temperature=0.8, top_k=6)
    want = process_logits(logits, [params]).softmax(-1)[0].tolist()
    draws = 6000
    generator = torch.Generator().manual_seed(0)
    rows = logits.expand(draws, -1).contiguous()
    result = sample(
        rows, [params] * draws, [[]] * draws, [generator] * draws, proposed=[proposal] * draws
    )
    counts = torch.bincount(result.token_ids, minlength=8).tolist()
    stat, df = chi_square(counts, want)
    assert stat < CHI2_LIMIT[df], (counts, want)
    if want[proposal] == 0:
        assert counts[proposal] == 0


def test_greedy_rows_keep_a_proposal_only_when_it_is_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    params = [SamplingParams(temperature=0.0)] * 2
    result = sample(logits, params, [[], []], [None, None], proposed=[1, 2])
    assert result.token_ids.tolist() == [1, 1]


def exact_pair_distribution(model, prompt: list[int], params: SamplingParams) -> list[float]:
    """P(2nd, 3rd generated token) of the target, summed over the 1st (V * V cells), from
    the model's own fp32 logits and the sampler's processing."""
    vocab = model.config.vocab_size

    def next_probs(ids: list[int]) -> torch.Tensor:
        logits = model(torch.tensor([ids]))[0, -1:].float()  # (1, V)
        return process_logits(logits, [params]).softmax(-1)[0]

    pair = torch.zeros(vocab, vocab, dtype=torch.float64)
    first = next_probs(prompt)
    for a in range(vocab):
        second = next_probs(prompt + [a])
        for b in range(vocab):
            pair[b] += first[a] * second[b] * next_probs(prompt + [a, b]).double()
    return pair.flatten().tolist()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_tokens_through_the_engine_follow_the_target_distribution(method, tmp_path):
    """A 4-token vocabulary: thousands of seeded requests with speculation on, the (2nd,
    3rd) tokens (those verified against proposals) counted against the exact
    distribution."""
    build_checkpoint(tmp_path / "target", "qwen3", vocab_size=4, bos_token_id=0, eos_token_id=3)
    target = qinfer.load_model(tmp_path / "target", dtype=torch.float32, device="cpu")
    settings = {"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": 2}
    if method == "draft":
        build_checkpoint(
            tmp_path / "draft", "qwen3", seed=1, vocab_size=4, bos_token_id=0, eos_token_id=3
        )
        draft = qinfer.load_model(tmp_path / "draft", dtype=torch.float32, device="cpu")
        settings = {"method": "draft", "model": draft, "num_speculative_tokens": 2}
    prompt = [1, 2, 0, 1, 2, 0, 1]
    params = SamplingParams(temperature=1.5, max_tokens=3, ignore_eos=True)
    draws = 3000
    llm = LLM(target, speculative=settings, max_num_seqs=64, max_num_batched_tokens=512)
    outputs = llm.generate(
        [prompt] * draws, [params.replace(seed=i) for i in range(draws)], use_tqdm=False
    )
    stats = llm.engine.stats()
    assert stats.spec_proposed_tokens_total > draws / 2, stats
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_proposed_tokens_total, stats
    counts = [0] * 16
    for out in outputs:
        counts[out.token_ids[1] * 4 + out.token_ids[2]] += 1
    want = exact_pair_distribution(target, prompt, params)
    assert math.isclose(sum(want), 1.0, rel_tol=1e-6)
    stat, df = chi_square(counts, want)
    limit = {15: 44.3, 14: 42.6, 13: 40.8, 12: 38.9, 11: 37.0}[df]  # 1 - 1e-4 quantiles
    assert stat < limit, (counts, want)


# -- bad settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens must be a positive",
        ),
        ({"method": "eagle"}, "speculative method must be one of ngram, draft"),
        ({"method": "draft"}, "speculative model is needed by method 'draft'"),
        ({"method": "ngram", "model": "x"}, "speculative model is for method 'draft'"),
        ({"method": "ngram", "k": 3}, "unknown speculative setting 'k'"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ("ngram", "speculative must be a mapping"),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_setting(model, settings, message):
    with pytest.raises(QinferError, match=message):
        LLM(model, speculative=settings)


def test_a_draft_with_another_vocabulary_is_refused(model, tmp_path):
    build_checkpoint(tmp_path, "qwen3", vocab_size=128)
    other = qinfer.load_model(tmp_path, dtype=torch.float32, device="cpu")
    with pytest.raises(QinferError, match="vocabulary of 128 tokens, the target 256"):
        LLM(model, speculative={"method": "draft", "model": other})


def test_a_draft_on_another_device_is_refused(model):
    elsewhere = SimpleNamespace(config=model.config, device=torch.device("meta"))
    with pytest.raises(QinferError, match="speculative model is on meta, the target on cpu"):
        DraftModel(elsewhere, model, num_blocks=4, block_size=16)


def test_cli_flags_that_need_another_are_refused_in_one_line(capsys):
    assert main(["generate", "hi", "--num-speculative-tokens", "3"]) == 2
    assert "--num-speculative-tokens needs --speculative-method" in capsys.readouterr().err
    assert main(["generate", "hi", "--speculative-method", "draft"]) == 2
    assert "--speculative-method draft needs --speculative-model" in capsys.readouterr().err


def test_cli_generate_with_prompt_lookup_prints_the_same_text(qwen3_chat_folder, capsys):
    args = ["generate", "abcabcabcabc", "--model", str(qwen3_chat_folder), "--dtype", "float32"]
    args += ["--max-tokens", "24", "--no-chat", "--temperature", "0"]
    assert main(args) == 0
    want = capsys.readouterr().out
    assert main([*args, "--speculative-method", "ngram", "--num-speculative-tokens", "3"]) == 0
    assert capsys.readouterr().out == want


# -- tensor parallelism and the server ----------------------------------------------------


def test_prompt_lookup_at_tp2_gives_the_tp1_tokens(qwen3, model):
    prompts = copying_prompts(6)
    want, _ = generate(model, prompts, GREEDY)
    llm = LLM(
        qwen3,
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        speculative={"method": "ngram"},
    )
    try:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        stats = llm.engine.stats()
    finally:
        llm.close()
    assert got == want
    assert stats.spec_accepted_tokens_total > 0


def test_the_server_speculates_and_counts_it(qwen3_chat_folder, chat_llms):
    prompt = "abcabcabcabcabc" * 3
    with serving(
        *("--model", str(qwen3_chat_folder), "--dtype", "float32", "--served-model-name", "m"),
        *("--speculative-method", "ngram", "--num-speculative-tokens", "3"),
    ) as server:
        body = {"model": "m", "prompt": prompt, "max_tokens": 20, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        with httpx.Client(base_url=server.url) as http:
            values = metric_values(http)
    plain, _ = chat_llms
    params = SamplingParams(temperature=0.0, max_tokens=20)
    assert reply["choices"][0]["text"] == plain.generate([prompt], params, use_tqdm=False)[0].text
    assert values["qinfer_spec_decode_proposed_tokens_total"] > 0
    assert values["qinfer_spec_decode_mean_accepted_length"] >= 1
    assert values["qinfer_generation_tokens_total"] == 20


def test_bench_reports_speed_up_and_acceptance(tmp_path, capsys):
    build_chat_checkpoint(tmp_path, "qwen3", max_position_embeddings=2048)  # byte-level prompts
    args = ["bench", "--model", str(tmp_path), "--dtype", "float32", "--repeats", "1"]
    args += ["--decode-tokens", "24"]
    assert main([*args, "--speculative-method", "ngram", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["speculative"] == {"method": "ngram"}
    for workload in ("edit", "chat"):
        rates = report[workload]["decode_tok_s"]
        assert set(rates) == {"off/0", "off/1", "on/0", "on/1"}
        assert report[workload]["speedup"] > 0
    assert 0 <= report["acceptance_rate"] <= 1 and report["mean_accepted_length"] >= 1


@pytest.mark.parametrize(
    "ids, want",
    [
        ([1, 2, 3, 4, 1, 2, 3], [4, 1]),  # the suffix seen once before: what followed it
        ([1, 2, 3, 7, 8, 2, 3, 9, 1, 2, 3], [7, 8]),  # the longest suffix wins over the latest
        ([5, 2, 3, 6, 9, 2, 3], [6, 9]),  # only the shortest matches: its latest occurrence
        ([4, 2, 3, 6, 5, 2, 3, 7, 2, 3], [7, 2]),
        ([1, 2, 3, 4, 5, 6], []),  # nothing seen before
        ([3, 3], []),  # too short for the shortest n-gram
    ],
)
def test_prompt_lookup_proposes_what_followed_the_longest_latest_match(ids, want):
    assert propose_ngram(ids, k=2, min_n=2, max_n=3) == want


def test_a_proposal_never_verified_leaves_the_draft_cache_as_the_tokens_kept(model):
    """A sequence whose proposal the scheduler cut (or did not run) is proposed for again:
    the draft's cache holds guesses that were never verified, and must not count them."""
    draft = DraftModel(model, model, num_blocks=8, block_size=16)
    seq = Sequence("a", copying_prompts(10, count=1)[0])
    seq.tables[0] = list(range(4))
    seq.num_computed_tokens = seq.num_tokens - 1  # prefilled; its last token to run
    [first] = draft.propose([seq], [3])
    assert len(first) == 3 and seq.num_draft_computed == seq.num_tokens + 2
    [again] = draft.propose([seq], [3])  # nothing was verified in between
    assert again == first
