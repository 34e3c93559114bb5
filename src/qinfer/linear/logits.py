"""fp32 logits from a head that multiplies in a narrower dtype.

The kernels that make bf16 decoding fast (int4/int8 weight-only, bf16 GEMMs) write bf16:
logits near 25 are then 0.125 apart, and near ties, which decide greedy text, are settled
by rounding (SmolLM2's first answer token: fp32 "The" 25.325 and "L" 25.243 came out of
the bf16 head both as 25.5). No fast CPU kernel of torch multiplies bf16 or int weights into
fp32 (fp32 activations make the int kernels 10-30x slower), so `fp32_logits` runs the
kernel for every logit (a quantized head: qinfer's int8-activation kernel where it runs,
which takes the fp32 input and writes fp32, `QuantizedLinear.logits`) and then recomputes
the highest of each row exactly (`EXACT_TOP` after bf16, `EXACT_TOP_INT8` after int8
activations): the fp32 input against the weight's rows as `dequantize` holds them, summed
in fp64 and rounded to fp32 (`exact_from_rows`), or for int8 blocks by the exact fp32 head
kernel on those rows alone, the bits of its whole product (`Int8BlockLinear.exact_logits`).
The greedy pick, the top logprobs and what a sampler keeps at any usual temperature, top-k
or top-p are fp32's; the rest keep the kernel's precision.

Every step is one row's own (a kernel that computes each row alike at any row count, a
top-k, a dot product per logit), so a row's logits do not depend on the other rows of its
step: a quantized head takes its kernel however many rows it is given (the tile paths'
GEMMs block by row count), where its other calls choose by row bucket.
"""

from __future__ import annotations

from typing import Protocol

import torch

from qinfer import kernels


class Head(Protocol):
    """What `fp32_logits` asks of a head (every `qinfer.linear.Linear` answers it)."""

    def same_at_any_rows(self, x: torch.Tensor) -> torch.Tensor: ...

    def has_rows(self) -> bool: ...

    def rows(self, ids: torch.Tensor) -> torch.Tensor: ...

    def exact_logits(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor: ...


#: Logits of each row recomputed exactly after a bf16 kernel: far more than bf16's rounding
#: (at most 1/256 of a logit) can reorder at the top.
EXACT_TOP = 16
#: The same after int8 activations (per block of 32, llama.cpp's q8_0), which move every
#: logit by more: with the top 16 recomputed SmolLM2 Q4_1's KL to fp32 on real text rose
#: past 0.75x llama.cpp's (0.00291 against a bound of 0.00269), with the top 256 it stayed
#: under it (0.00250; the exact head 0.00220; docs/BENCHMARKS.md).
EXACT_TOP_INT8 = 256


def fp32_logits(
    head: Head,
    x: torch.Tensor,
    dtype: torch.dtype,
    exact: bool | None = None,
    top: int = EXACT_TOP,
) -> torch.Tensor:
    """x (R, K) fp32 -> (R, N) fp32 logits of `head` (R rows of the final norm's output):
    the kernel on x in `dtype`, then each row's `top` highest recomputed exactly
    (`Head.exact_logits`, where the head can read its rows; else the kernel's values).
    exact: whether the kernel's logits are fp32's already (default: when `dtype` is
    float32; a kernel that rounds fp32 activations to int8 is not)."""
    logits = head.same_at_any_rows(x.to(dtype)).float()  # (R, N)
    if (dtype == torch.float32 if exact is None else exact) or not head.has_rows():
        return logits
    ids = top_ids(logits, min(top, logits.shape[-1]))  # (R, k)
    return logits.scatter_(-1, ids, head.exact_logits(x, ids))


def top_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """(R, N) fp32 -> (R, k) int64, each row's k highest columns: the compiled kernel's one
    pass (`kernels.top_k_ids`) on the CPU where it loads, else torch.topk (the same set but
    for which of equal logits it takes)."""
    if logits.device.type == "cpu" and kernels.available() is None:
        return kernels.top_k_ids(logits.contiguous(), k)
    return logits.topk(k, dim=-1).indices


def exact_from_rows(head: Head, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x (R, K) fp32, ids (R, k) -> (R, k) fp32: x against the weight's rows at ids as
    `dequantize` holds them (`rows`), summed in fp64 and rounded to fp32."""
    rows = head.rows(ids).double()  # (R, k, K)
    return torch.bmm(rows, x.double()[..., None]).squeeze(-1).float()  # (R, k)
