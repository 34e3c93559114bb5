"""qinfer.kernels.gated_delta_recurrent, the compiled recurrent (decode) form of the gated
delta rule: within fp32 rounding of the torch form (`recurrent_gated_delta_rule`), each
sequence the same bits alone as in any batch and on any thread count, strided inputs read
as contiguous ones, bad inputs refused in one line, and the layer's choice between the two
forms.

Tolerance: the op sums k^T S and q^T S in another order than torch's bmm; outputs and state
entries are of order 1 and a few tokens deep, so 1e-5 is some 100 fp32 units.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import max_diff
from test_deltanet import inputs

from qinfer import kernels
from qinfer.attention.deltanet import recurrent_gated_delta_rule
from qinfer.layers import gated_deltanet

TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    reason = kernels.available()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize(
    "shape",
    [
        dict(B=3, L=1, H=4, Dk=32, Dv=24),  # decode, Dv not a multiple of 16
        dict(B=2, L=7, H=3, Dk=16, Dv=8),  # several tokens (a verification)
        dict(B=2, L=1, H=16, Dk=128, Dv=128),  # Qwen3.5-0.8B's heads
    ],
)
def test_matches_torch_form(shape):
    """Outputs and the final state within fp32 rounding of the torch form."""
    *args, state = inputs(**shape)
    want, want_state = recurrent_gated_delta_rule(*args, state.clone())
    got_state = state.clone()
    got = kernels.gated_delta_recurrent(*args, got_state)
    assert max_diff(got, want) < TOLERANCE
    assert max_diff(got_state, want_state) < TOLERANCE


def test_sequence_alone_equals_in_batch():
    """A sequence's output and state are the same bits alone, in a batch of 5 and on 1 or 2
    threads: each (sequence, head) is one task with one order of sums."""
    *args, state = inputs(B=5, L=3, H=4, Dk=32, Dv=32, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch_state = state.clone()
        batch = kernels.gated_delta_recurrent(*args, batch_state)
        torch.set_num_threads(1)
        for b in range(5):
            alone_state = state[b : b + 1].clone()
            alone = kernels.gated_delta_recurrent(*(x[b : b + 1] for x in args), alone_state)
            assert torch.equal(alone, batch[b : b + 1])
            assert torch.equal(alone_state, batch_state[b : b + 1])
    finally:
        torch.set_num_threads(threads)


def test_strided_inputs():
    """q, k, v as slices of wider rows (as the layer's conv output splits them) and g, beta
    transposed views give the contiguous inputs' bits."""
    q, k, v, g, beta, state = inputs(B=2, L=2, H=3, Dk=16, Dv=8, seed=2)
    wide = torch.cat((q, k, v), dim=-1)  # (B, L, H, 2 Dk + Dv)
    qs, ks, vs = wide.split([16, 16, 8], dim=-1)
    gt, bt = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (g, beta))
    assert not vs.is_contiguous() and not gt.is_contiguous()
    want_state, got_state = state.clone(), state.clone()
    want = kernels.gated_delta_recurrent(q, k, v, g, beta, want_state)
    got = kernels.gated_delta_recurrent(qs, ks, vs, gt, bt, got_state)
    assert torch.equal(got, want)
    assert torch.equal(got_state, want_state)


def test_bad_inputs_refused():
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
            kernels.gated_delta_recurrent(*args)
        assert "\n" not in str(error.value).strip()


@pytest.mark.parametrize("compiled", [True, False])
def test_layer_picks_form(monkeypatch, compiled):
    """The layer's token-by-token rule is the compiled op where the kernels are in use and
    the torch form where they are not (QINFER_CPU_KERNELS=off), bit for bit."""
    monkeypatch.setattr(kernels, "in_use", lambda: compiled)
    *args, state = inputs(B=2, L=2, H=3, Dk=16, Dv=8, seed=3)
    got, got_state = gated_deltanet.token_by_token(*args, state.clone())
    want_state = state.clone()
    if compiled:
        want = kernels.gated_delta_recurrent(*args, want_state)
    else:
        want, want_state = recurrent_gated_delta_rule(*args, want_state)
    assert torch.equal(got, want)
    assert torch.equal(got_state, want_state)
