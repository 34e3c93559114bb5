"""Cache invariance: feeding a sequence in pieces through a KV cache gives the logits of
one forward over the whole sequence (transformers' fp32 logits are the reference)."""

import pytest
import torch
from checkpoints import max_diff, random_tokens, reference_logits

from qinfer.attention.kv_cache import GROWTH_STEP, KVCache, RotatingKVCache
from qinfer.core.errors import CacheError

TOLERANCE = 1e-4
TOTAL = 40  # tokens per sequence: five times the widest window (8)


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(1, TOTAL)


@pytest.fixture(scope="module")
def want(windowed_pair, tokens):
    reference, _ = windowed_pair
    return reference_logits(reference, tokens)


def feed(model, tokens, sizes, cache=None):
    """Run tokens (1, sum(sizes)) through one cache in pieces of `sizes`; concat the logits."""
    cache = model.make_cache(1) if cache is None else cache
    pieces, start = [], 0
    for size in sizes:
        pieces.append(model(tokens[:, start : start + size], cache=cache))
        start += size
    return torch.cat(pieces, dim=1)


def test_prefill_then_decode_one_at_a_time(windowed_pair, tokens, want):
    _, model = windowed_pair
    prompt = 12
    got = feed(model, tokens, [prompt] + [1] * (TOTAL - prompt))
    assert max_diff(got, want) < TOLERANCE


def test_chunked_prefill(windowed_pair, tokens, want):
    _, model = windowed_pair
    # Chunks shorter and longer than the windows (6, 8), then a few single tokens.
    got = feed(model, tokens, [5, 7, 3, 11, 9, 1, 1, 3])
    assert max_diff(got, want) < TOLERANCE


def test_trim_then_refeed_other_tokens(windowed_pair, tokens):
    """Rewind the last 4 positions, feed different tokens there: as if never fed the old ones."""
    reference, model = windowed_pair
    cache = model.make_cache(1)
    model(tokens[:, :6], cache=cache)
    assert all(layer.trim(4) == 4 for layer in cache)
    other = random_tokens(1, 6, seed=7)
    got = feed(model, other, [4, 1, 1], cache=cache)
    rewritten = torch.cat([tokens[:, :2], other], dim=1)
    assert max_diff(got, reference_logits(reference, rewritten)[:, 2:]) < TOLERANCE


def test_trim_of_the_contiguous_cache_far_into_the_sequence(windowed_pair, tokens):
    reference, model = windowed_pair
    if any(model.config.window(i) for i in range(model.config.num_hidden_layers)):
        pytest.skip("a sliding-window cache cannot rewind past its window")
    cache = model.make_cache(1)
    model(tokens[:, :30], cache=cache)
    for layer in cache:
        layer.trim(12)
    got = model(tokens[:, 18:], cache=cache)
    assert max_diff(got, reference_logits(reference, tokens)[:, 18:]) < TOLERANCE


def test_rotating_cache_refuses_to_rewind_past_its_window():
    cache = RotatingKVCache(window=4)
    cache.update_and_fetch(torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2), 6, "causal")
    with pytest.raises(CacheError, match="window"):
        cache.trim(1)


def test_contiguous_cache_grows_in_steps_not_per_token():
    cache = KVCache(max_length=4096)
    step = torch.zeros(1, 2, 1, 4)
    buffers = set()
    for _ in range(GROWTH_STEP + 1):
        cache.update_and_fetch(step, step, 1, "causal")
        buffers.add(cache.keys.data_ptr())
    assert len(buffers) == 2  # one growth at GROWTH_STEP + 1 tokens
    assert cache.keys.shape[2] == 2 * GROWTH_STEP


def test_rotating_cache_holds_only_its_window():
    cache = RotatingKVCache(window=8)
    for size in (5, 11, 1, 1, 20):
        cache.update_and_fetch(
            torch.zeros(1, 2, size, 4), torch.zeros(1, 2, size, 4), size, "causal"
        )
        assert cache.keys.shape == (1, 2, 8, 4)
    assert cache.offset == 38


def test_reset_then_another_sequence(windowed_pair, tokens):
    reference, model = windowed_pair
    cache = model.make_cache(1)
    feed(model, tokens, [20, 1, 1], cache=cache)
    for layer in cache:
        layer.reset()
    other = random_tokens(1, 12, seed=5)
    got = feed(model, other, [7, 1, 4], cache=cache)
    assert max_diff(got, reference_logits(reference, other)) < TOLERANCE


def test_rotating_cache_for_fewer_positions_than_its_window_is_that_small():
    # A single forward pass of 10 tokens through a 4096-token window needs 10 slots.
    cache = RotatingKVCache(window=4096, max_length=10)
    cache.update_and_fetch(torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4), 10, "causal")
    assert cache.keys.shape == (1, 2, 10, 4)


def test_the_seeds_attention_call_in_pieces_equals_one_call(windowed_pair):
    """`Attention(x, offsets, cache, mask)` as the seed calls it: prefill then decode
    through one layer's own cache gives that layer's output over the whole input at once
    (windows included)."""
    _, model = windowed_pair
    attention = model.layers[0].self_attn
    torch.manual_seed(0)
    x = torch.randn(2, 12, model.config.hidden_size)  # (B, L, hidden)
    whole = attention(x, 0, model.make_cache(2)[0], "causal")
    cache = model.make_cache(2)[0]
    pieces, start = [], 0
    for size in (7, 1, 3, 1):
        pieces.append(attention(x[:, start : start + size], start, cache, "causal"))
        start += size
    assert max_diff(torch.cat(pieces, dim=1), whole) < 1e-5
