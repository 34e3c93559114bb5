"""A hybrid model's Gated DeltaNet tensors as llama.cpp's converter stores them, back to the
Hugging Face layout our `layers/gated_deltanet.py` reads (conversion/qwen.py:
`Qwen3NextModel.modify_tensors`, and `_LinearAttentionVReorderBase` for qwen35/qwen35moe).

What the converter does, and what undoes it here:

- `A_log` is stored as `ssm_a` = -exp(A_log): read back as log(-ssm_a);
- the conv1d kernel (C, 1, K) is stored squeezed (C, K): read back with its middle axis;
- Qwen3.5's value heads, where there are more of them than key heads (r = Hv / Hk > 1), are
  stored tiled, (r, Hk, d) (value head i of every key head, then i + 1 ...), where
  transformers groups them by key head, (Hk, r, d): the rows of the v part of `in_proj_qkv`
  and of the conv kernel, of `in_proj_z`, `in_proj_b`, `in_proj_a`, `A_log`, `dt_bias`,
  and the input columns of `out_proj`, are gathered back into grouped order. Qwen3-Next's
  files (qwen3next) keep the grouped order.

The gathers need whole tensors: the DeltaNet is never split between tensor-parallel ranks
(`GatedDeltaNet.place`). A quantized weight keeps its blocks: rows move with their scales,
and `out_proj`'s columns move by whole blocks where a value head is a whole number of them
(the released models' heads of 128); elsewhere it is dequantized (`gathered`).
"""

from __future__ import annotations

import dataclasses

import torch

from qinfer.core.model_config import DeltaNetConfig
from qinfer.linear import Int4Groups, Int8Blocks, StoredWeight
from qinfer.linear.int8_blocks import SUPER_BLOCK

#: The DeltaNet's tensors under our names, relative to `model.layers.N.linear_attn.`.
QKV, Z, B, A = "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"
CONV, A_LOG, DT_BIAS, OUT = "conv1d.weight", "A_log", "dt_bias", "out_proj.weight"
PREFIX = ".linear_attn."


class DeltaNetTensors:
    """Which gathers and value maps undo the converter, by our tensor name."""

    def __init__(self, shapes: DeltaNetConfig, value_heads_tiled: bool) -> None:
        """value_heads_tiled: the file stores value heads tiled (qwen35, qwen35moe)."""
        Hk, Hv = shapes.num_key_heads, shapes.num_value_heads
        r = Hv // Hk
        self._rows: dict[str, torch.Tensor] = {}
        self._columns: dict[str, torch.Tensor] = {}
        if value_heads_tiled and r > 1:

            def grouped(d: int) -> torch.Tensor:
                """For each row of grouped order (Hk, r, d), the tiled (r, Hk, d) row
                holding it."""
                return torch.arange(Hv * d).reshape(r, Hk, d).transpose(0, 1).flatten()

            qk = torch.arange(2 * shapes.key_dim)  # q and k rows stay where they are
            channels = torch.cat([qk, len(qk) + grouped(shapes.value_head_dim)])
            heads = grouped(1)
            self._rows = {QKV: channels, CONV: channels, Z: grouped(shapes.value_head_dim)}
            self._rows |= {name: heads for name in (B, A, A_LOG, DT_BIAS)}
            self._columns = {OUT: grouped(shapes.value_head_dim)}

    @staticmethod
    def _part(name: str) -> str | None:
        """`name` relative to its DeltaNet (None: not a DeltaNet tensor)."""
        _, found, part = name.partition(PREFIX)
        return part if found else None

    def rows(self, name: str) -> torch.Tensor | None:
        """For each of our rows of `name`, the stored row (None: rows as stored)."""
        return self._rows.get(self._part(name) or "")

    def columns(self, name: str) -> torch.Tensor | None:
        """For each of our input columns of `name`, the stored column (None: as stored)."""
        return self._columns.get(self._part(name) or "")

    def shape(self, name: str, stored: tuple[int, ...]) -> tuple[int, ...]:
        """Our shape of a tensor stored with shape `stored` (the conv kernel's middle axis)."""
        if self._part(name) == CONV and len(stored) == 2:
            return (stored[0], 1, stored[1])
        return stored

    def value(self, name: str, stored: torch.Tensor) -> torch.Tensor:
        """Our values of a dense tensor read as `stored` (rows and columns already ours)."""
        part = self._part(name)
        if part == A_LOG:
            return torch.log(-stored.float()).to(stored.dtype)
        if part == CONV and stored.dim() == 2:
            return stored.unsqueeze(1)
        return stored


def gathered(
    weight: StoredWeight, rows: torch.Tensor | None, columns: torch.Tensor | None
) -> StoredWeight | None:
    """`weight` (dense, or int4 groups / int8 blocks / int8 rows) with its rows and input
    columns gathered; None where the columns would split its blocks (a value head that is
    not a whole number of blocks): the caller dequantizes it then."""
    if isinstance(weight, torch.Tensor):
        weight = weight if rows is None else weight[rows]
        return weight if columns is None else weight[:, columns]
    if isinstance(weight, Int8Blocks) and columns is not None:
        if weight.super_scales is not None and _blocks_of(columns, SUPER_BLOCK) is None:
            weight = weight.flattened()  # it would split Q6_K's super-blocks
    fields = {f.name: getattr(weight, f.name) for f in dataclasses.fields(weight)}
    fields = {key: value for key, value in fields.items() if value is not None}
    if rows is not None:  # every field's rows: q, and the scales (and zeros) of its blocks
        fields = {key: value[rows] for key, value in fields.items()}
    if columns is not None:
        K = weight.q.shape[1]
        fields["q"] = fields["q"][:, columns]
        if isinstance(weight, Int4Groups | Int8Blocks):  # scales per block: blocks move whole
            for key in [k for k in fields if k != "q"]:
                blocks = _blocks_of(columns, K // fields[key].shape[1])
                if blocks is None:
                    return None
                fields[key] = fields[key][:, blocks]
    return type(weight)(**fields)


def _blocks_of(columns: torch.Tensor, block: int) -> torch.Tensor | None:
    """The gather of whole blocks of `block` columns that `columns` is (None: it splits one)."""
    if len(columns) % block:
        return None
    starts = columns.reshape(-1, block)
    aligned = not (starts[:, 0] % block).any()
    if not aligned or not torch.equal(starts, starts[:, :1] + torch.arange(block)):
        return None
    return starts[:, 0] // block
