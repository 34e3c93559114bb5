"""qinfer.kernels.gated_delta_recurrent and gated_delta_chunked, the compiled forms of the
gated delta rule: within fp32 rounding of the torch forms (`recurrent_gated_delta_rule`,
`chunked_gated_delta_rule`) and of each other, each sequence the same bits alone as in any
batch and on any thread count, strided inputs read as contiguous ones, bad inputs refused
in one line, and the layer's choice between compiled and torch forms. gated_delta_decode,
a decode token's whole mixer (conv, norms, gates, rule) as one op: the same against the
layer's torch steps.

Tolerance: the ops sum in other orders than torch's bmm and solve; outputs and state entries
are of order 1, so 1e-5 is some 100 fp32 units.
"""

from __future__ import annotations

import functools

import pytest
import torch
from checkpoints import max_diff
from test_deltanet import inputs

from qinfer import kernels
from qinfer.attention.deltanet import (
    CHUNK_SIZE,
    causal_conv1d,
    chunked_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from qinfer.layers import gated_deltanet

TOLERANCE = 1e-5

#: Each compiled form (chunked at 16 tokens a chunk) beside its torch twin.
FORMS = {
    "recurrent": (kernels.gated_delta_recurrent, recurrent_gated_delta_rule),
    "chunked": (
        functools.partial(kernels.gated_delta_chunked, chunk_size=16),
        functools.partial(chunked_gated_delta_rule, chunk_size=16),
    ),
}


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    reason = kernels.available()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "shape",
    [
        dict(B=3, L=1, H=4, Dk=32, Dv=24),  # decode, Dv not a multiple of 16
        dict(B=2, L=39, H=3, Dk=20, Dv=8),  # several chunks, the last ragged; Dk not of 16
        dict(B=1, L=20, H=16, Dk=128, Dv=128),  # Qwen3.5-0.8B's heads
    ],
)
def test_matches_torch_form(form, shape):
    """Outputs and the final state within fp32 rounding of the torch form."""
    compiled, torch_form = FORMS[form]
    *args, state = inputs(**shape)
    want, want_state = torch_form(*args, state.clone())
    got_state = state.clone()
    got = compiled(*args, got_state)
    assert max_diff(got, want) < TOLERANCE
    assert max_diff(got_state, want_state) < TOLERANCE


@pytest.mark.parametrize("chunk_size", [1, 7, 32, 100])
def test_chunked_equals_recurrent(chunk_size):
    """Any chunk size (one token, ragged, one chunk longer than the prompt) gives the
    compiled recurrent form's outputs and state."""
    *args, state = inputs(B=2, L=45, H=2, Dk=16, Dv=16, seed=4)
    want_state, got_state = state.clone(), state.clone()
    want = kernels.gated_delta_recurrent(*args, want_state)
    got = kernels.gated_delta_chunked(*args, got_state, chunk_size)
    assert max_diff(got, want) < TOLERANCE
    assert max_diff(got_state, want_state) < TOLERANCE


@pytest.mark.parametrize("form", FORMS)
def test_sequence_alone_equals_in_batch(form):
    """A sequence's output and state are the same bits alone, in a batch of 5 and on 1 or 2
    threads: each (sequence, head) is one task with one order of sums."""
    compiled, _ = FORMS[form]
    *args, state = inputs(B=5, L=19, H=4, Dk=32, Dv=32, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch_state = state.clone()
        batch = compiled(*args, batch_state)
        torch.set_num_threads(1)
        for b in range(5):
            alone_state = state[b : b + 1].clone()
            alone = compiled(*(x[b : b + 1] for x in args), alone_state)
            assert torch.equal(alone, batch[b : b + 1])
            assert torch.equal(alone_state, batch_state[b : b + 1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("form", FORMS)
def test_strided_inputs(form):
    """q, k, v as slices of wider rows (as the layer's conv output splits them) and g, beta
    transposed views give the contiguous inputs' bits."""
    compiled, _ = FORMS[form]
    q, k, v, g, beta, state = inputs(B=2, L=18, H=3, Dk=16, Dv=8, seed=2)
    qs, ks, vs = torch.cat((q, k, v), dim=-1).split([16, 16, 8], dim=-1)
    gt, bt = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (g, beta))
    assert not vs.is_contiguous() and not gt.is_contiguous()
    want_state, got_state = state.clone(), state.clone()
    want = compiled(q, k, v, g, beta, want_state)
    got = compiled(qs, ks, vs, gt, bt, got_state)
    assert torch.equal(got, want)
    assert torch.equal(got_state, want_state)


@pytest.mark.parametrize("form", FORMS)
def test_bad_inputs_refused(form):
    compiled, _ = FORMS[form]
    q, k, v, g, beta, state = inputs(B=2, L=1, H=3, Dk=16, Dv=8)
    cases = [
        ((q.double(), k, v, g, beta, state), "q must be"),
        ((q, k, v, g[:, :, :2], beta, state), "g must be"),
        ((q, k, v, g, beta, state.transpose(2, 3)), "state must be contiguous"),
        ((q[..., :8], k, v, g, beta, state), "q's last dimension"),
        ((q, k, v[..., ::2], g, beta, state[..., :4]), "v must be"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message) as error:
            compiled(*args)
        assert "\n" not in str(error.value).strip()
    with pytest.raises(RuntimeError, match="chunk_size must be positive"):
        kernels.gated_delta_chunked(q, k, v, g, beta, state, 0)
    with pytest.raises(RuntimeError, match="slot 5 of sequence 1 is outside the state's 2 rows"):
        kernels.gated_delta_recurrent(q, k, v, g, beta, state, torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="slots must be contiguous"):
        kernels.gated_delta_chunked(
            q, k, v, g, beta, state, 8, torch.tensor([0, 1], dtype=torch.int32)
        )


@pytest.mark.parametrize(("chunked", "chunk_size"), [(False, None), (True, 8), (True, None)])
@pytest.mark.parametrize("compiled", [True, False])
def test_layer_picks_form(monkeypatch, compiled, chunked, chunk_size):
    """The layer's rule is the compiled op where the kernels are in use and the torch form
    where they are not (QINFER_CPU_KERNELS=off), bit for bit: token by token, chunked at the
    size given, or at each form's own (`GATED_DELTA_CHUNK`, `CHUNK_SIZE`)."""
    monkeypatch.setattr(kernels, "in_use", lambda: compiled)
    *args, state = inputs(B=2, L=40, H=3, Dk=16, Dv=8, seed=3)
    # the two sequences' states in rows 2 and 0 of a pool of 4, rows 1 and 3 another's
    pool = torch.randn(4, *state.shape[1:], generator=torch.Generator().manual_seed(9))
    slots = torch.tensor([2, 0])
    pool[slots] = state
    untouched = pool[[1, 3]].clone()
    got = gated_deltanet.gated_delta_rule(*args, pool, slots, chunked, chunk_size)
    got_state = pool[slots]
    assert torch.equal(pool[[1, 3]], untouched)
    want_state = state.clone()
    if not chunked:
        form = kernels.gated_delta_recurrent if compiled else recurrent_gated_delta_rule
    elif compiled:
        size = chunk_size or kernels.GATED_DELTA_CHUNK
        form = functools.partial(kernels.gated_delta_chunked, chunk_size=size)
    else:
        form = functools.partial(chunked_gated_delta_rule, chunk_size=chunk_size or CHUNK_SIZE)
    want = form(*args, want_state)
    if not compiled:
        want, want_state = want
    assert torch.equal(got, want)
    assert torch.equal(got_state, want_state)


# ------------------------------------------------------------------ one decode token, fused


def decode_inputs(S=3, Hk=2, H=4, Dk=16, Dv=8, K=4, P=6, seed=0):
    """One token's mixer inputs: qkv (S, C) as columns of a wider projection (strided rows),
    b and a (S, H) likewise; taps (K, C); the windows and state pools (P rows), slots."""
    gen = torch.Generator().manual_seed(seed)
    C = 2 * Hk * Dk + H * Dv
    projected = torch.randn(S, C + 2 * H + 5, generator=gen)
    qkv, b, a, _ = projected.split([C, H, H, 5], dim=-1)
    taps = torch.randn(K, C, generator=gen) * 0.5
    windows = torch.randn(P, K - 1, C, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    state = torch.randn(P, H, Dk, Dv, generator=gen)
    slots = torch.randperm(P, generator=gen)[:S]
    return qkv, b, a, taps, windows, A_log, dt_bias, state, slots, Hk


def decode_by_torch(qkv, b, a, taps, windows, A_log, dt_bias, state, slots, Hk):  # noqa: N803
    """The layer's torch steps for one token: conv and SiLU, L2 norms, gates, the rule."""
    S, H, Dk, Dv = qkv.shape[0], state.shape[1], state.shape[2], state.shape[3]
    mixed, window = causal_conv1d(qkv[:, None], taps.t(), windows[slots])
    q, k, v = mixed.split([Hk * Dk, Hk * Dk, H * Dv], dim=-1)
    q, k = (l2_normalize(x.reshape(S, 1, Hk, Dk)).repeat_interleave(H // Hk, dim=2) for x in (q, k))
    beta = b[:, None].sigmoid()
    g = -A_log.exp() * torch.nn.functional.softplus(a[:, None] + dt_bias)
    out, final = recurrent_gated_delta_rule(q, k, v.reshape(S, 1, H, Dv), g, beta, state[slots])
    return out[:, 0], window, final


@pytest.mark.parametrize(
    "shape",
    [
        dict(),  # two value heads a key head, Dv not a multiple of 16
        dict(S=1, Hk=16, H=16, Dk=128, Dv=128, P=2),  # Qwen3.5-0.8B's layer
        dict(S=2, Hk=1, H=3, Dk=20, Dv=24, K=2),  # a two-tap conv, odd sizes
    ],
)
def test_decode_matches_torch_steps(shape):
    """Output and state within fp32 rounding of the layer's torch steps (its SiLU's exp is
    a series within 2 ulp of torch's), the windows shifted exactly, other rows untouched."""
    args = decode_inputs(**shape)
    qkv, b, a, taps, windows, A_log, dt_bias, state, slots, Hk = args
    want, want_window, want_state = decode_by_torch(*args)
    others = [row for row in range(state.shape[0]) if row not in slots.tolist()]
    untouched = (windows[others].clone(), state[others].clone())
    got = kernels.gated_delta_decode(*args)
    assert got.shape == want.shape
    assert max_diff(got, want) < TOLERANCE
    assert max_diff(state[slots], want_state) < TOLERANCE
    assert torch.equal(windows[slots], want_window)
    assert torch.equal(windows[others], untouched[0]) and torch.equal(state[others], untouched[1])


def test_decode_sequence_alone_equals_in_batch():
    """A sequence's output, window and state are the same bits alone as in a batch of 5,
    on 1 or 2 threads."""
    qkv, b, a, taps, windows, A_log, dt_bias, state, slots, Hk = decode_inputs(S=5, P=7, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch_windows, batch_state = windows.clone(), state.clone()
        batch = kernels.gated_delta_decode(
            qkv, b, a, taps, batch_windows, A_log, dt_bias, batch_state, slots, Hk
        )
        torch.set_num_threads(1)
        for s in range(5):
            alone_windows, alone_state = windows.clone(), state.clone()
            one = slice(s, s + 1)
            alone = kernels.gated_delta_decode(
                qkv[one], b[one], a[one], taps, alone_windows, A_log, dt_bias, alone_state,
                slots[one], Hk,
            )  # fmt: skip
            row = slots[s]
            assert torch.equal(alone, batch[one])
            assert torch.equal(alone_windows[row], batch_windows[row])
            assert torch.equal(alone_state[row], batch_state[row])
    finally:
        torch.set_num_threads(threads)


def test_decode_bad_inputs_refused():
    args = decode_inputs()
    qkv, b, a, taps, windows, A_log, dt_bias, state, slots, Hk = args

    def replaced(**changes):
        names = ("qkv", "b", "a", "taps", "windows", "A_log", "dt_bias", "state", "slots", "Hk")
        return [changes.get(name, value) for name, value in zip(names, args, strict=True)]

    cases = [
        (replaced(qkv=qkv[:, :-1]), "qkv must be \\(S, 96\\) .* got \\(3, 95\\)"),
        (replaced(Hk=3), "key_heads must divide state's 4 heads"),
        (replaced(windows=windows.bfloat16()), "windows must be fp32"),
        (replaced(taps=taps.t()), "taps must be contiguous \\(K, 96\\)"),
        (replaced(b=b[:, :2]), "b must be \\(3, 4\\)"),
        (
            replaced(slots=torch.tensor([0, 1, 9])),
            "slot 9 of sequence 2 is outside the pools' 6 rows",
        ),
        (replaced(state=state.transpose(2, 3)), "state must be a contiguous pool"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message) as error:
            kernels.gated_delta_decode(*call)
        assert "\n" not in str(error.value).strip()


# ------------------------------------------------------------------ the conv, compiled


@pytest.mark.parametrize("L", [1, 2, 3, 40])  # fewer tokens than the window, and more
@pytest.mark.parametrize("K", [4, 2])
def test_conv_matches_torch_form(L, K):
    """`causal_conv1d` compiled: its outputs within a few fp32 units of the torch form's
    (the SiLU's exp a series within 2 ulp of torch's), each window replaced by the torch
    form's bit for bit, the pool's other rows untouched; x read by its strides."""
    gen = torch.Generator().manual_seed(L + K)
    S, C, P = 3, 200, 5
    x = torch.randn(S, L, C + 7, generator=gen)[..., 3 : 3 + C]  # strided rows
    taps = torch.randn(K, C, generator=gen)
    windows = torch.randn(P, K - 1, C, generator=gen)
    slots = torch.tensor([4, 0, 2])
    want, want_windows = causal_conv1d(x, taps.t(), windows[slots])
    untouched = windows[[1, 3]].clone()
    got = kernels.causal_conv1d(x, taps, windows, slots)
    assert max_diff(got, want) < 1e-6 * (1 + want.abs().max().item())
    assert torch.equal(windows[slots], want_windows)
    assert torch.equal(windows[[1, 3]], untouched)


def test_conv_sequence_alone_equals_in_batch():
    gen = torch.Generator().manual_seed(5)
    x, taps = torch.randn(4, 9, 300, generator=gen), torch.randn(4, 300, generator=gen)
    windows = torch.randn(4, 3, 300, generator=gen)
    slots = torch.tensor([2, 3, 0, 1])
    batch_windows = windows.clone()
    batch = kernels.causal_conv1d(x, taps, batch_windows, slots)
    for s in range(4):
        alone_windows = windows.clone()
        alone = kernels.causal_conv1d(x[s : s + 1], taps, alone_windows, slots[s : s + 1])
        assert torch.equal(alone, batch[s : s + 1])
        assert torch.equal(alone_windows[slots[s]], batch_windows[slots[s]])


def test_conv_bad_inputs_refused():
    x, taps, windows = torch.randn(2, 5, 64), torch.randn(4, 64), torch.zeros(3, 3, 64)
    slots = torch.tensor([0, 2])
    cases = [
        ((x.double(), taps, windows, slots), "x must be fp32"),
        ((x[..., :32], taps, windows, slots), "x must be \\(S, L, 64\\) for taps' 64 channels"),
        ((x, taps.t(), windows, slots), "x must be \\(S, L, 4\\)"),
        ((x, taps[:, :, None], windows, slots), "taps must be \\(K, C\\)"),
        ((x, taps.t().contiguous().t(), windows, slots), "taps must be contiguous \\(K, 64\\)"),
        (
            (x[..., ::2], taps, windows, slots),
            "each token's contiguous, got \\(2, 5, 32\\)",
        ),
        ((x, taps, windows[:, :2], slots), "windows must be a contiguous pool \\(P, 3, 64\\)"),
        ((x, taps, windows, torch.tensor([0, 3])), "slot 3 of sequence 1 is outside the pool's"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message) as error:
            kernels.causal_conv1d(*args)
        assert "\n" not in str(error.value).strip()
