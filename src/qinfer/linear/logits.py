"""fp32 logits from a head that multiplies in a narrower dtype.

The kernels that make bf16 decoding fast (int4/int8 weight-only, bf16 GEMMs) write bf16:
logits near 25 are then 0.125 apart, and near ties, which decide greedy text, are settled
by rounding (SmolLM2's first answer token: fp32 "The" 25.325 and "L" 25.243 came out of
the bf16 head both as 25.5). No fast CPU kernel of torch multiplies bf16 or int weights into
fp32 (fp32 activations make the int kernels 10-30x slower), so `fp32_logits` runs the
kernel for every logit (a quantized head: qinfer's int8-activation kernel where it runs,
which takes the fp32 input and writes fp32, `QuantizedLinear.logits`) and then recomputes
the `EXACT_TOP` highest of each row exactly:
the fp32 input against the weight's rows as `dequantize` holds them, summed in fp64 and
rounded to fp32. The greedy pick, the top logprobs and what a sampler keeps at any usual
temperature, top-k or top-p are fp32's; the rest keep the kernel's precision.

Every step is one row's own (a kernel that computes each row alike at any row count, top-k,
gather, a dot product per logit), so a row's logits do not depend on the other rows of its
step: a quantized head takes its kernel however many rows it is given (the tile paths'
GEMMs block by row count), where its other calls choose by row bucket.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Head(Protocol):
    """What `fp32_logits` asks of a head (every `qinfer.linear.Linear` answers it)."""

    def same_at_any_rows(self, x: torch.Tensor) -> torch.Tensor: ...

    def has_rows(self) -> bool: ...

    def rows(self, ids: torch.Tensor) -> torch.Tensor: ...


#: Logits of each row recomputed exactly: far more than bf16's rounding (at most 1/256 of
#: a logit) can reorder at the top.
EXACT_TOP = 16


def fp32_logits(
    head: Head, x: torch.Tensor, dtype: torch.dtype, exact: bool | None = None
) -> torch.Tensor:
    """x (R, K) fp32 -> (R, N) fp32 logits of `head` (R rows of the final norm's output):
    the kernel on x in `dtype`, then each row's EXACT_TOP highest recomputed from x and the
    weight's rows (where the head can read its rows; else the kernel's values). exact:
    whether the kernel's logits are fp32's already (default: when `dtype` is float32; a
    kernel that rounds fp32 activations to int8 is not)."""
    logits = head.same_at_any_rows(x.to(dtype)).float()  # (R, N)
    if (dtype == torch.float32 if exact is None else exact) or not head.has_rows():
        return logits
    top = logits.topk(min(EXACT_TOP, logits.shape[-1]), dim=-1).indices  # (R, k)
    rows = head.rows(top).double()  # (R, k, K)
    exact = torch.bmm(rows, x.double()[..., None]).squeeze(-1)  # (R, k)
    return logits.scatter_(-1, top, exact.float())
