"""The kernels' ops as torch sees them from Python, registered in one place once the library
loads (`bind`): each op's fake kernel (its output's shape and dtype from the inputs', what
`torch.compile` and `torch.export` trace a graph with), a one-line refusal of tensors off the
CPU, and the bound overloads the wrappers call (`ops`). The machine's answers (the build,
the CPU's paths) are marked as constants of a traced graph (`constant_in_graphs`).
library.cpp registers the same ops' schemas and CPU kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import NoReturn, TypeVar

import torch

BLOCK = 32  # input columns per weight / activation block

#: What `torch.compiler.assume_constant_result` sets on a function, set here without it:
#: that decorator imports torch._dynamo, 71 MB of resident memory in every process that
#: loads the kernels (tests/test_kernel_tracing.py checks that the two still agree).
CONSTANT_MARK = "_dynamo_marked_constant"

#: The devices whose tensors the ops refuse in one line (the dispatcher's own message for a
#: device with no kernel is some 40 lines).
REFUSED_DEVICES = ("cuda", "mps", "xpu")

T = TypeVar("T")


def constant_in_graphs(cached: Callable[[], T]) -> Callable[[], T]:
    """A cached answer about the machine (not about tensors), which `torch.compile` takes
    as a constant of the graph it traces instead of tracing into (the build, the CPU's
    flags). `cache_clear` is the cached function's, as the tests use it."""

    def answer() -> T:
        return cached()

    functools.update_wrapper(answer, cached)
    answer.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    answer.cache_info = cached.cache_info  # type: ignore[attr-defined]
    setattr(answer, CONSTANT_MARK, True)
    return answer


def _rows_by_columns(x: torch.Tensor, columns: torch.Tensor, *_: object) -> torch.Tensor:
    return x.new_empty((x.shape[0], columns.shape[0]), dtype=torch.float32)  # (M, N)


def _rows_by_n(x, qs, d, m, n: int, *_: object) -> torch.Tensor:  # noqa: ANN001
    return x.new_empty((x.shape[0], n), dtype=torch.float32)  # (M, N): the int4 column tiles'


def _blocks_by_columns(x, q, d, path="auto", d_super=None, ids=None) -> torch.Tensor:  # noqa: ANN001
    columns = q.shape[0] if ids is None else ids.shape[1]
    return x.new_empty((x.shape[0], columns), dtype=torch.float32)  # (M, N) or (M, k)


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    return logits.new_empty((logits.shape[0], k), dtype=torch.int64)  # (R, k)


def _quantized(x: torch.Tensor, path: str = "auto") -> tuple[torch.Tensor, ...]:
    M, K = x.shape
    blocks = (M, K // BLOCK)
    return (
        x.new_empty((M, K), dtype=torch.int8),
        x.new_empty(blocks, dtype=torch.float32),
        x.new_empty(blocks, dtype=torch.int32),
    )


def _add_normed(h, x, w, eps, dtype: torch.dtype, path="auto") -> torch.Tensor:  # noqa: ANN001
    return h.new_empty(h.shape, dtype=dtype)


def _heads_normed(h, w1, w2, first, eps, dtype: torch.dtype, path="auto") -> torch.Tensor:  # noqa: ANN001
    return h.new_empty(h.shape, dtype=dtype)


def _like(x: torch.Tensor, *_: object) -> torch.Tensor:  # attention's q, RoPE's x, the conv's
    return x.new_empty(x.shape)


def _halved(x: torch.Tensor) -> torch.Tensor:  # silu_mul's (T, 2W) -> (T, W)
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def _delta_out(q, k, v: torch.Tensor, *_: object) -> torch.Tensor:  # noqa: ANN001
    return v.new_empty(v.shape, dtype=torch.float32)  # (B, L, H, Dv)


def _delta_decoded(qkv, b, a, taps, windows, A_log, dt_bias, state, *_: object):  # noqa: ANN001, ANN202, N803
    return qkv.new_empty((qkv.shape[0], state.shape[1], state.shape[3]))  # (S, H, Dv)


def _in_place(*_: object) -> None:  # lora_add: y updated, nothing returned
    return None


#: Each op that takes tensors -> its fake kernel.
FAKE_KERNELS = {
    "int4_mm": _rows_by_n,
    "int8_mm": _rows_by_columns,
    "int8_blocks_mm": _blocks_by_columns,
    "top_k_ids": _top_k,
    "int4_groups_mm": _rows_by_n,
    "quantize_q8_1": _quantized,
    "add_rms_norm": _add_normed,
    "heads_rms_norm": _heads_normed,
    "paged_decode_attention": _like,
    "rope": _like,
    "causal_attention": _like,
    "silu_mul": _halved,
    "lora_add": _in_place,
    "gated_delta_recurrent": _delta_out,
    "gated_delta_chunked": _delta_out,
    "gated_delta_decode": _delta_decoded,
    "causal_conv1d": _like,
}

#: The ops' default overloads, bound once the library is loaded (None before): torch.ops'
#: attribute lookups and the overload resolution cost about 3 µs a call, a tenth of a small
#: decode matmul.
ops = SimpleNamespace(**dict.fromkeys(FAKE_KERNELS))


def bind() -> None:
    """Registers the Python side of the loaded library's ops and binds `ops`."""
    for name, kernel in FAKE_KERNELS.items():
        torch.library.register_fake(f"qinfer::{name}")(kernel)
        torch.library.impl(f"qinfer::{name}", REFUSED_DEVICES, refusal(name))
        setattr(ops, name, getattr(torch.ops.qinfer, name).default)


def refusal(name: str) -> Callable[..., NoReturn]:
    """The kernel op `name` runs on tensors off the CPU: a one-line error naming the op and
    the devices of its tensor arguments."""

    def refuse(*args: object, **kwargs: object) -> NoReturn:
        devices = sorted(
            {str(a.device) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        )
        raise RuntimeError(
            f"qinfer::{name} runs on CPU tensors only, got tensors on {', '.join(devices)}"
        )

    return refuse
