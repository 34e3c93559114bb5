"""The gated delta rule's two torch forms (`qinfer.attention.deltanet`): chunked and
recurrent held to each other and to transformers' `torch_chunk_gated_delta_rule` /
`torch_recurrent_gated_delta_rule`, in fp32; the causal conv's rolling window; the
recurrent-state pool's slots."""

import pytest
import torch
from checkpoints import HYBRID, max_diff, tiny_config
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from qinfer.attention.deltanet import (
    causal_conv1d,
    chunked_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from qinfer.attention.state_pool import StatePool
from qinfer.core.errors import QinferError

TOLERANCE = 2e-6  # fp32, outputs of order 1


def inputs(B=2, L=150, H=3, Dk=16, Dv=8, seed=0):
    """Random rule inputs: normalised q, k; decays in (-2, 0); beta in (0, 1); a start state."""
    g = torch.Generator().manual_seed(seed)
    q, k = (l2_normalize(torch.randn(B, L, H, Dk, generator=g)) for _ in range(2))
    v = torch.randn(B, L, H, Dv, generator=g)
    decay = -2 * torch.rand(B, L, H, generator=g)
    beta = torch.rand(B, L, H, generator=g)
    state = torch.randn(B, H, Dk, Dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("chunk_size", [16, 64, 200])
def test_chunked_equals_recurrent(chunk_size):
    """Any chunk size (several chunks, a ragged last one, one chunk longer than the
    prompt) gives the token-by-token rule's outputs and final state."""
    *args, state = inputs()
    out, final = chunked_gated_delta_rule(*args, state.clone(), chunk_size=chunk_size)
    want_out, want_state = recurrent_gated_delta_rule(*args, state.clone())
    assert max_diff(out, want_out) < TOLERANCE
    assert max_diff(final, want_state) < 10 * TOLERANCE


def test_both_forms_equal_transformers():
    """Each form against its transformers twin, from a non-zero start state."""
    q, k, v, g, beta, state = inputs()
    kwargs = dict(initial_state=state, output_final_state=True)
    for ours, theirs in (
        (chunked_gated_delta_rule, torch_chunk_gated_delta_rule),
        (recurrent_gated_delta_rule, torch_recurrent_gated_delta_rule),
    ):
        out, final = ours(q, k, v, g, beta, state.clone())
        want_out, want_final = theirs(q, k, v, g, beta, **kwargs)
        assert max_diff(out, want_out) < TOLERANCE
        assert max_diff(final, want_final) < TOLERANCE


def test_prompt_in_pieces_equals_whole():
    """A prompt run in chunks of the rule, each from the last one's state, then decoded a
    token at a time, equals the whole at once: the state carries everything."""
    q, k, v, g, beta, state = inputs(L=90)
    want, want_state = chunked_gated_delta_rule(q, k, v, g, beta, state.clone())
    outs = []
    for start, end in ((0, 40), (40, 87)):
        part = (x[:, start:end] for x in (q, k, v, g, beta))
        out, state = chunked_gated_delta_rule(*part, state, chunk_size=16)
        outs.append(out)
    for t in range(87, 90):
        out, state = recurrent_gated_delta_rule(
            *(x[:, t : t + 1] for x in (q, k, v, g, beta)), state
        )
        outs.append(out)
    assert max_diff(torch.cat(outs, dim=1), want) < TOLERANCE
    assert max_diff(state, want_state) < 10 * TOLERANCE


def test_conv_window_rolls_across_pieces():
    """The causal conv over a sequence in pieces (1 token, fewer than the window, more)
    equals it over the whole, as transformers' zero-padded causal_conv1d_fn computes it."""
    g = torch.Generator().manual_seed(0)
    B, C, K, L = 2, 6, 4, 12
    x, weight = torch.randn(B, C, L, generator=g), torch.randn(C, K, generator=g)
    whole = torch.nn.functional.silu(
        torch.nn.functional.conv1d(x, weight.unsqueeze(1), padding=K - 1, groups=C)[..., :L]
    )
    window, outs = torch.zeros(B, K - 1, C), []
    tokens = x.transpose(1, 2)  # (B, L, C): token-major, as the layer holds them
    for start, end in ((0, 1), (1, 3), (3, 9), (9, 12)):
        out, window = causal_conv1d(tokens[:, start:end], weight, window)
        outs.append(out)
    assert max_diff(torch.cat(outs, dim=1), whole.transpose(1, 2)) < 1e-6
    assert torch.equal(window, tokens[:, L - (K - 1) :])


def test_state_pool_slots():
    """A slot is zeroed when taken, given back once; an exhausted or empty pool and a slot
    freed twice are one-line errors."""
    config = tiny_config("qwen3_5", **HYBRID["qwen3_5"])
    pool = StatePool(config, 2)
    assert sorted(pool.conv) == [0, 2] and pool.recurrent[0].shape == (2, 4, 16, 16)
    assert pool.conv[0].shape == (2, 3, 2 * 32 + 64)
    first = pool.allocate()
    pool.recurrent[0][first] = 1.0
    pool.free(first)
    assert pool.allocate() == first and pool.recurrent[0][first].abs().sum() == 0
    pool.allocate()
    with pytest.raises(QinferError, match="slots are all in use"):
        pool.allocate()
    pool.free(first)
    with pytest.raises(QinferError, match="not in use"):
        pool.free(first)
    with pytest.raises(QinferError, match="at least one slot"):
        StatePool(config, 0)
