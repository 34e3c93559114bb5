"""Batch invariance: each row of a left-padded batch gets the logits it gets alone
(transformers' fp32 logits of that row alone are the reference), at prefill and at every
decode step after it, with full and sliding-window attention."""

import pytest
import torch
from checkpoints import (
    max_diff,
    random_tokens,
    reference_logits,
    use_features,
)

import qinfer

TOLERANCE = 1e-4
PROMPT_LENGTHS = [5, 14, 9]  # the longest passes both windows (6, 8); the others are padded
DECODE_STEPS = 6
PAD_ID = 0


@pytest.fixture(scope="module")
def rows():
    """Per row: its prompt followed by the tokens decoded after it, (1, length + steps)."""
    return [random_tokens(1, n + DECODE_STEPS, seed=10 + i) for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def want(windowed_pair, rows):
    """Per row: transformers' logits for the row alone, (1, length + steps, V)."""
    reference, _ = windowed_pair
    return [reference_logits(reference, row) for row in rows]


@pytest.fixture(params=[True, False], ids=["fast-sdpa", "reference-sdpa"])
def model(request, windowed_pair):
    _, model = windowed_pair
    use_features(model, qinfer.Features(fast_sdpa=request.param))
    return model


def left_padded_prompts(rows):
    """(B, longest) prompts padded on the left, and the padding of each row."""
    longest = max(PROMPT_LENGTHS)
    padding = [longest - n for n in PROMPT_LENGTHS]
    prompts = torch.full((len(rows), longest), PAD_ID, dtype=torch.long)
    for b, (row, n) in enumerate(zip(rows, PROMPT_LENGTHS, strict=True)):
        prompts[b, padding[b] :] = row[0, :n]
    return prompts, padding


def prefill(model, rows):
    prompts, padding = left_padded_prompts(rows)
    cache = model.make_cache(len(rows), left_padding=padding)
    return cache, padding, model(prompts, cache=cache)


def decode_step(model, rows, cache, step, keep):
    """Feed rows `keep` their token number `step` after the prompt; logits (len(keep), 1, V)."""
    tokens = torch.stack([rows[b][0, PROMPT_LENGTHS[b] + step] for b in keep])[:, None]
    return model(tokens, cache=cache)


def test_prefill_of_a_left_padded_batch(model, rows, want):
    _, padding, logits = prefill(model, rows)
    for b, pad in enumerate(padding):
        assert max_diff(logits[b : b + 1, pad:], want[b][:, : PROMPT_LENGTHS[b]]) < TOLERANCE


def test_chunked_prefill_of_a_left_padded_batch_then_a_multi_token_step(model, rows, want):
    prompts, padding = left_padded_prompts(rows)
    cache = model.make_cache(len(rows), left_padding=padding)
    chunks = [
        model(prompts[:, start:end], cache=cache) for start, end in [(0, 6), (6, 7), (7, None)]
    ]
    logits = torch.cat(chunks, dim=1)
    after = torch.stack([row[0, n : n + 3] for row, n in zip(rows, PROMPT_LENGTHS, strict=True)])
    next_logits = model(after, cache=cache)
    for b, (pad, n) in enumerate(zip(padding, PROMPT_LENGTHS, strict=True)):
        assert max_diff(logits[b : b + 1, pad:], want[b][:, :n]) < TOLERANCE
        assert max_diff(next_logits[b : b + 1], want[b][:, n : n + 3]) < TOLERANCE


def test_padding_rows_stay_finite(model, rows):
    cache, _, logits = prefill(model, rows)
    assert torch.isfinite(logits).all()  # pad positions included
    logits = decode_step(model, rows, cache, 0, keep=range(len(rows)))
    assert torch.isfinite(logits).all()
    for layer in cache:
        history = layer.keys if layer.window is None else layer.keys[:, :, : layer.offset]
        assert torch.isfinite(history).all()


def test_per_row_offsets_come_from_the_cache(model, rows):
    cache, _, _ = prefill(model, rows)
    assert torch.equal(cache[0].offsets, torch.tensor(PROMPT_LENGTHS))
    decode_step(model, rows, cache, 0, keep=range(len(rows)))
    assert torch.equal(cache[0].offsets, torch.tensor(PROMPT_LENGTHS) + 1)


def test_decode_steps_after_a_left_padded_prefill(model, rows, want):
    cache, _, _ = prefill(model, rows)
    for step in range(DECODE_STEPS):
        logits = decode_step(model, rows, cache, step, keep=range(len(rows)))
        for b, n in enumerate(PROMPT_LENGTHS):
            assert max_diff(logits[b : b + 1], want[b][:, n + step : n + step + 1]) < TOLERANCE


def test_select_rows_mid_decode_keeps_the_others_unchanged(model, rows, want):
    cache, _, _ = prefill(model, rows)
    for step in range(2):
        decode_step(model, rows, cache, step, keep=range(len(rows)))
    keep = [0, 2]  # the longest row finishes
    for layer in cache:
        layer.select(keep)
    assert torch.equal(cache[0].offsets, torch.tensor([PROMPT_LENGTHS[b] + 2 for b in keep]))
    for step in range(2, DECODE_STEPS):
        logits = decode_step(model, rows, cache, step, keep=keep)
        assert torch.isfinite(logits).all()
        for i, b in enumerate(keep):
            n = PROMPT_LENGTHS[b]
            assert max_diff(logits[i : i + 1], want[b][:, n + step : n + step + 1]) < TOLERANCE
