"""Sampling: each processing step against `transformers`' logits processors, then the sampler.

Processed logits are compared exactly (masks) or to 1e-6 (arithmetic) with the HF
processor given the same row; the sampler is checked for greedy rows, seeds, per-row
independence inside a batch and the returned log-probabilities.
"""

import json
from collections import Counter

import pytest
import torch
import transformers

from qinfer import SamplingParams
from qinfer.core.errors import QinferError, SamplingError
from qinfer.request.sampling import (
    ARGMAX_LOGITS_PER_THREAD,
    ARGMAX_SLICED_FROM,
    ThinkingBudget,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    argmax_rows,
    make_generator,
    process_logits,
    sample,
    sampling_distribution,
    sliced_argmax,
)

VOCAB = 64


@pytest.fixture
def logits():
    torch.manual_seed(0)
    return torch.randn(4, VOCAB) * 3  # (B, V), spread enough that the masks bite


@pytest.fixture
def histories():
    torch.manual_seed(1)
    return [torch.randint(0, VOCAB, (n,)).tolist() for n in (12, 1, 30, 7)]


def hf_row(processor, logits_row, history=(0,)):
    """Apply one transformers processor to one row: (V,) -> (V,)."""
    return processor(torch.tensor([list(history)]), logits_row[None].clone())[0]


def test_repetition_penalty_matches_transformers(logits, histories):
    penalties = [1.3, 1.0, 0.7, 2.0]
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    processed = apply_penalties(logits, params, histories)
    for b, penalty in enumerate(penalties):
        reference = hf_row(
            transformers.RepetitionPenaltyLogitsProcessor(penalty), logits[b], histories[b]
        )
        torch.testing.assert_close(processed[b], reference, rtol=0, atol=1e-6)


def test_repetition_penalty_counts_the_prompt(logits):
    prompt_token = int(logits[0].argmax())
    params = [SamplingParams(repetition_penalty=2.0)]
    processed = apply_penalties(logits[:1], params, [[prompt_token]], prompt_lens=[1])
    assert processed[0, prompt_token] != logits[0, prompt_token]


def test_presence_and_frequency_penalties_count_generated_tokens_only(logits, histories):
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)] * 4
    prompt_lens = [5, 0, 10, 7]
    processed = apply_penalties(logits, params, histories, prompt_lens)
    expected = logits.clone()
    for b, history in enumerate(histories):
        for token, count in Counter(history[prompt_lens[b] :]).items():
            expected[b, token] -= 0.25 * count + 0.5
    torch.testing.assert_close(processed, expected, rtol=0, atol=1e-6)


def test_rows_without_penalties_are_untouched(logits, histories):
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0)] * 2
    processed = apply_penalties(logits, params, histories)
    assert torch.equal(processed[0], logits[0]) and torch.equal(processed[2], logits[2])


def test_temperature_divides_the_logits_like_transformers(logits):
    temperatures = [0.5, 1.0, 1.7, 0.25]
    processed = process_logits(logits, [SamplingParams(temperature=t) for t in temperatures])
    for b, t in enumerate(temperatures):
        reference = hf_row(transformers.TemperatureLogitsWarper(t), logits[b])
        torch.testing.assert_close(processed[b], reference, rtol=1e-6, atol=0)


def test_top_k_mask_matches_transformers(logits):
    top_k = [1, 5, 0, VOCAB + 10]  # 0 and k > V keep everything
    processed = apply_top_k(logits, torch.tensor(top_k))
    for b, k in enumerate(top_k):
        expected = logits[b] if k == 0 else hf_row(transformers.TopKLogitsWarper(k), logits[b])
        assert torch.equal(processed[b], expected)


def test_top_p_mask_matches_transformers(logits):
    top_p = [0.1, 0.5, 0.9, 1.0]
    processed = apply_top_p(logits, torch.tensor(top_p))
    for b, p in enumerate(top_p):
        assert torch.equal(processed[b], hf_row(transformers.TopPLogitsWarper(p), logits[b]))


def test_min_p_mask_matches_transformers(logits):
    min_p = [0.05, 0.2, 0.9, 0.0]
    processed = apply_min_p(logits, torch.tensor(min_p))
    for b, p in enumerate(min_p):
        expected = logits[b] if p == 0 else hf_row(transformers.MinPLogitsWarper(p), logits[b])
        assert torch.equal(processed[b], expected)


def test_processing_chain_matches_transformers_order(logits):
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05)
    processed = process_logits(logits, [params] * 4)
    chain = transformers.LogitsProcessorList(
        [
            transformers.TemperatureLogitsWarper(0.7),
            transformers.TopKLogitsWarper(20),
            transformers.TopPLogitsWarper(0.8),
            transformers.MinPLogitsWarper(0.05),
        ]
    )
    reference = chain(torch.zeros(4, 1, dtype=torch.long), logits.clone())
    torch.testing.assert_close(processed, reference, rtol=1e-6, atol=0)


def test_temperature_zero_takes_the_argmax_after_penalties(logits):
    history = [int(logits[0].argmax())]
    params = [SamplingParams(temperature=0.0, repetition_penalty=5.0)]
    result = sample(logits[:1], params, [history], [None])
    expected = apply_penalties(logits[:1], params, [history]).argmax(dim=-1)
    assert torch.equal(result.token_ids, expected)
    assert result.token_ids[0] != history[0]


def test_top_k_one_equals_greedy(logits):
    params = [SamplingParams(temperature=1.5, top_k=1, seed=s) for s in range(4)]
    generators = [make_generator(p, "cpu") for p in params]
    result = sample(logits, params, [[]] * 4, generators)
    assert torch.equal(result.token_ids, logits.argmax(dim=-1))


def test_seeded_sampling_reproduces(logits):
    params = [SamplingParams(temperature=1.0, seed=1234)] * 4

    def draw():
        generators = [make_generator(p, "cpu") for p in params]
        return [sample(logits, params, [[]] * 4, generators).token_ids for _ in range(5)]

    first, second = draw(), draw()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_row_samples_the_same_alone_or_in_a_batch(logits, histories):
    params = [
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.2, logprobs=0),
        SamplingParams(temperature=1.3, top_k=10, seed=8, presence_penalty=1.0, logprobs=0),
        SamplingParams(
            temperature=0.5, top_k=40, min_p=0.1, seed=9, frequency_penalty=0.5, logprobs=0
        ),
    ]
    batched = sample(logits, params, histories, [make_generator(p, "cpu") for p in params])
    for b, p in enumerate(params):
        alone = sample(logits[b : b + 1], [p], [histories[b]], [make_generator(p, "cpu")])
        assert alone.token_ids[0] == batched.token_ids[b]
        torch.testing.assert_close(alone.logprobs[0], batched.logprobs[b])


def test_sample_frequencies_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = [SamplingParams(temperature=0.5, seed=0)]
    generator = make_generator(params[0], "cpu")
    draws = [int(sample(logits, params, [[]], [generator]).token_ids[0]) for _ in range(4000)]
    frequencies = torch.bincount(torch.tensor(draws), minlength=4) / len(draws)
    torch.testing.assert_close(frequencies, (logits[0] / 0.5).softmax(-1), atol=0.02, rtol=0)


def test_top_k_rows_sample_from_their_candidates_with_the_full_vocabulary_probabilities(logits):
    params = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.2, top_k=30, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=12, min_p=0.1),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    probs, candidates = sampling_distribution(logits, params)  # (B, K)
    assert candidates.shape == (4, 30)
    full = torch.zeros_like(logits).scatter(1, candidates, probs)
    torch.testing.assert_close(full, process_logits(logits, params).softmax(dim=-1))


def test_top_k_sample_frequencies_follow_the_truncated_distribution():
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0, 1.5, 0.0]])
    params = [SamplingParams(temperature=1.0, top_k=3, seed=0)]
    generator = make_generator(params[0], "cpu")
    draws = [int(sample(logits, params, [[]], [generator]).token_ids[0]) for _ in range(4000)]
    frequencies = torch.bincount(torch.tensor(draws), minlength=6) / len(draws)
    expected = process_logits(logits, params).softmax(dim=-1)[0]  # zero outside ids 1, 3, 4
    torch.testing.assert_close(frequencies, expected, atol=0.02, rtol=0)


def test_logprobs_are_of_the_penalised_distribution(logits, histories):
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.9, top_k=5, seed=3, repetition_penalty=1.5, logprobs=0),
        SamplingParams(temperature=2.0, seed=4),
        SamplingParams(temperature=0.3, top_p=0.5, seed=5, logprobs=5),
    ]
    result = sample(logits, params, histories, [make_generator(p, "cpu") for p in params])
    log_probs = apply_penalties(logits, params, histories).log_softmax(dim=-1)
    expected = log_probs.gather(1, result.token_ids[:, None])[:, 0]
    torch.testing.assert_close(result.logprobs, expected)
    assert result.top_logprobs[1] == [] and result.top_logprobs[2] is None
    for b in (0, 3):
        values, ids = log_probs[b].topk(params[b].logprobs)
        assert [i for i, _ in result.top_logprobs[b]] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in result.top_logprobs[b]]), values)


def test_logprobs_are_computed_only_when_a_row_asks():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=1)]
    result = sample(logits[:2], params, [[]] * 2, [None, make_generator(params[1], "cpu")])
    assert result.logprobs is None and result.top_logprobs == [None, None]
    asked = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=0)]
    result = sample(logits[:2], asked, [[]] * 2, [None, None])
    expected = torch.log_softmax(logits[:2], -1).gather(1, result.token_ids[:, None])[:, 0]
    torch.testing.assert_close(result.logprobs, expected)  # every row's, once one asks
    assert result.top_logprobs == [None, []]


@pytest.mark.parametrize("vocab", [ARGMAX_SLICED_FROM, 49152, 151936, ARGMAX_SLICED_FROM + 1])
def test_sliced_argmax_is_argmax_with_its_ties_and_nans(vocab):
    """Sliced argmax == torch's argmax: the first index of the maximum, NaN counted as the
    largest, wherever it falls (the short tail slice included)."""
    generator = torch.Generator().manual_seed(vocab)
    for trial in range(40):
        logits = torch.randint(-3, 3, (4, vocab), generator=generator).float()  # many ties
        columns = torch.randint(0, vocab, (3,), generator=generator)
        logits[1, columns[:2]] = float("nan")
        logits[2, -1] = 9.0  # the maximum in the tail
        logits[3, columns[2]] = 9.0
        assert torch.equal(sliced_argmax(logits), logits.argmax(dim=-1)), trial
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1)), trial
    rows = (ARGMAX_LOGITS_PER_THREAD // vocab + 1) * torch.get_num_threads()
    many = torch.randn(rows, vocab)  # more logits per thread than one argmax pass: sliced
    assert torch.equal(argmax_rows(many), many.argmax(dim=-1))
    small = torch.randn(2, 100)  # below ARGMAX_SLICED_FROM: one pass
    assert torch.equal(argmax_rows(small), small.argmax(dim=-1))


def test_make_generator_is_none_without_a_seed():
    assert make_generator(SamplingParams(), "cpu") is None


def test_logits_of_the_wrong_shape_are_an_error(logits):
    with pytest.raises(SamplingError, match=r"logits of shape \(B, V\), got \(4, 1, 64\)"):
        sample(logits[:, None], [SamplingParams()] * 4, [[]] * 4, [None] * 4)


def test_mismatched_rows_are_an_error(logits):
    with pytest.raises(SamplingError, match="4 rows of logits but 1 params"):
        sample(logits, [SamplingParams()], [[]], [None])


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("max_tokens", -1),
        ("prompt_logprobs", 21),
        ("stop", ["x"] * 17),
        ("stop", [3]),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("seed", -5),
        ("logprobs", 21),
        ("ignore_eos", "yes"),
    ],
)
def test_invalid_parameter_is_rejected_naming_the_field(field, value):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**{field: value})


def test_sampling_errors_are_qinfer_errors():
    assert issubclass(SamplingError, QinferError)


def test_single_stop_values_become_tuples():
    params = SamplingParams(stop="###", stop_token_ids=7)
    assert (params.stop, params.stop_token_ids) == (("###",), (7,))


def test_stop_of_the_wrong_kind_is_rejected():
    with pytest.raises(SamplingError, match="stop must be a list"):
        SamplingParams(stop={"text": "###"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_sampling_on_cuda_reproduces_and_greedy_agrees_with_cpu(logits, histories):
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=0),
        SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05, seed=1, logprobs=0),
        SamplingParams(
            temperature=1.1, presence_penalty=0.5, frequency_penalty=0.5, seed=2, logprobs=0
        ),
    ]
    cuda_logits, rows = logits[:3].cuda(), histories[:3]

    def draw():
        generators = [make_generator(p, "cuda") for p in params]
        return sample(cuda_logits, params, rows, generators)

    first, second = draw(), draw()
    assert torch.equal(first.token_ids, second.token_ids)
    cpu = sample(logits[:1], params[:1], rows[:1], [None])
    assert first.token_ids[0].item() == cpu.token_ids[0].item()
    torch.testing.assert_close(first.logprobs[0].cpu(), cpu.logprobs[0])


QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}


def test_generation_config_gives_the_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3_GENERATION_CONFIG))
    params = SamplingParams.from_generation_config(tmp_path)
    assert (params.temperature, params.top_k, params.top_p) == (0.6, 20, 0.95)
    assert params.min_p == SamplingParams().min_p


def test_overrides_win_and_none_overrides_are_ignored():
    params = SamplingParams.from_generation_config(
        QWEN3_GENERATION_CONFIG, temperature=0.0, top_k=None, max_tokens=10
    )
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 20, 10)


def test_do_sample_false_means_greedy():
    params = SamplingParams.from_generation_config({"do_sample": False, "temperature": 0.6})
    assert params.greedy and params.temperature == 0.0


def test_folder_without_generation_config_decodes_greedily(tmp_path):
    """As transformers' generate does with its default GenerationConfig (do_sample false)."""
    assert SamplingParams.from_generation_config(tmp_path) == SamplingParams(temperature=0.0)
    assert SamplingParams.from_generation_config(None, temperature=0.7).temperature == 0.7


def test_unknown_override_is_rejected():
    with pytest.raises(SamplingError, match="unknown sampling parameter 'temprature'"):
        SamplingParams.from_generation_config(None, temprature=0.5)


def test_invalid_value_in_generation_config_names_the_field():
    with pytest.raises(SamplingError, match="top_p"):
        SamplingParams.from_generation_config({"top_p": 0.0})


class BanEvenIds:
    """A logits processor that forbids every even id and records what it is told."""

    def __init__(self):
        self.accepted, self.released = [], False

    def __call__(self, logits):
        logits[0::2] = float("-inf")
        return logits

    def accept(self, token_id):
        self.accepted.append(token_id)

    def release(self):
        self.released = True


def test_logits_processors_run_per_row_before_the_penalties(logits, histories):
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3)] * 4
    generators = [None] * 4
    processors = [[BanEvenIds()], [], [BanEvenIds()], []]
    original = logits.clone()
    result = sample(logits, params, histories, generators, logits_processors=processors)
    assert torch.equal(logits, original)  # the caller's logits are left alone
    plain = sample(logits, params, histories, generators)
    banned = original.clone()
    banned[[0, 2], 0::2] = float("-inf")
    expected = apply_penalties(banned, params, histories).argmax(dim=-1)
    assert result.token_ids.tolist() == expected.tolist()
    assert all(t % 2 == 1 for t in result.token_ids[[0, 2]].tolist())
    assert result.token_ids[[1, 3]].tolist() == plain.token_ids[[1, 3]].tolist()


def test_thinking_budget_forces_the_close_once_spent():
    """Inside the block the budget counts tokens; once spent only </think> may come, and
    after it nothing is masked. A first token that does not open the block ends it."""
    budget = ThinkingBudget(2, think_open=5, think_close=6, inside=False)
    logits = torch.zeros(8)
    for token in (5, 1, 2):  # <think>, then two tokens of reasoning
        assert torch.isfinite(budget(logits.clone())).all()
        budget.accept(token)
    forced = budget(logits.clone())
    assert forced.argmax().item() == 6 and torch.isinf(forced[torch.arange(8) != 6]).all()
    budget.accept(6)
    assert torch.isfinite(budget(logits.clone())).all()
    answering = ThinkingBudget(0, think_open=5, think_close=6, inside=False)
    answering.accept(3)  # answered without thinking: never forced
    assert torch.isfinite(answering(logits.clone())).all()
    with pytest.raises(SamplingError, match="thinking_budget"):
        SamplingParams(thinking_budget=-1)
