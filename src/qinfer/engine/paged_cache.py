"""Where the engine's K/V live: one preallocated pool of blocks, read through block tables.

`KVPool` holds the keys and values of every layer as `num_blocks * block_size` token
slots; slot `block_id * block_size + i` holds position i of that block.

One engine step is one forward, whatever mix of decode tokens and prompt chunks it holds.
`StepLayout` packs the new tokens of all its sequences into one (R, C) grid (`pack`): the
model computes logits only at the grid's last column (`last_only`), so every sequence that
wants logits ends a grid row of its own, and the other tokens fill the remaining cells.
Three decode tokens a, b, c and a 5-token chunk x1..x5 that ends its prompt:

    x1 a
    x2 b        tokens (4, 2); logits at a, b, c and x5
    x3 c
    x4 x5

Each token carries its own position (RoPE takes per-token positions); only attention
cares which sequence a token belongs to, and `PagedCache.attend` (one layer) sorts that
out: it writes the step's K/V into the pool, then attends the queries of each group of
sequences adding the same number of new tokens to their own histories:

- decode (one new token each): the keys are copied as whole blocks (one row of
  block_size * Hkv * D values per block, not one per token), scores and softmax are fp32
  as in every attention path, and the weighted sum of the values is one `embedding_bag`
  that reads each value row where it sits in the pool: the values are never copied;
- chunks (several new tokens each): keys and values copied as whole blocks, then the
  attention layer's own sdpa.

A group's histories are padded to its longest (in whole blocks) and masked by position.
Sliding-window layers keep their whole history in the pool and are masked to their window
(correct, but they use as much memory as full-attention layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qinfer.config import ModelConfig
from qinfer.errors import CacheError
from qinfer.kv_cache import Mask, Sdpa, position_mask

#: What a row of logits nobody reads costs, in tokens run through the layers: the lm_head
#: of SmolLM2-135M on CPU takes 0.7 ms a row, its layers 1.45 ms a token (`pack`).
LOGITS_ROW_COST = 0.5

#: Padded keys a cut must spare for a group to be split in two (`split_by_history`): on
#: CPU one more group per layer costs about what ~1000 keys cost (SmolLM2-135M, bf16).
SPLIT_KEYS = 1024


class KVPool:
    """K and V of every layer: (num_layers, num_slots, Hkv, D) each, allocated once.

    num_kv_heads: Hkv, the KV heads this rank holds (default: the config's, all of them;
    under tensor parallelism, `Parallel.attention_heads`).
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_kv_heads: int | None = None,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (
            config.num_hidden_layers,
            num_blocks * block_size,
            num_kv_heads or config.num_key_value_heads,
            config.head_dim,
        )
        # Zeros, not empty: padded reads take (masked) slots, and NaN garbage would
        # survive a mask in a matmul.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(
        config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None
    ) -> int:
        """Bytes one block takes across all layers, keys and values (of num_kv_heads KV
        heads; default: the config's)."""
        heads = num_kv_heads or config.num_key_value_heads
        per_token = 2 * config.num_hidden_layers * heads * config.head_dim
        return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def pack(num_new: list[int], wants_logits: list[bool]) -> tuple[int, int, list[list[int]]]:
    """Where the new tokens of each row go in one (R, C) grid: (R, C, cells), cells[b] the
    flat cells r * C + c of row b's tokens, in order.

    Grid row r ends with the last token of the r-th row that wants logits; every other
    token takes the next free cell (row-major), and the cells left over are padding. R is
    at least the number of rows that want logits (1 if none does), chosen to waste least:
    a pad cell costs a token's pass through the layers, a grid row more than needed costs
    a row of logits nobody reads (LOGITS_ROW_COST). The shortest grid leaves fewer pad
    cells than it has rows, which is what twice as many extra rows cost: no grid taller
    than 3x is tried. Rows of equal length that all want logits get the plain
    (rows, length) batch.
    """
    total, wanting = sum(num_new), sum(wants_logits)
    needed = max(1, wanting)

    def waste(rows: int) -> float:
        return rows * -(-total // rows) - total + LOGITS_ROW_COST * (rows - needed)

    R = min(range(needed, min(total, 3 * needed) + 1), key=waste)
    C = -(-total // R)
    ends = [r * C + C - 1 for r in range(wanting)]
    reserved = set(ends)
    free = (cell for cell in range(R * C) if cell not in reserved)
    next_end = iter(ends)
    cells = []
    for n, wants in zip(num_new, wants_logits, strict=True):
        row = [next(free) for _ in range(n - wants)]
        if wants:
            row.append(next(next_end))
        cells.append(row)
    return R, C, cells


class StepLayout:
    """One forward of the engine: its token grid, and where the K/V of each token go to and
    come from in the pool. Shared by the `PagedCache` of every layer.

    Per sequence b: new_tokens[b] (the ids it runs now), num_computed[b] (tokens already
    in the pool, at positions 0..num_computed[b]-1), block_tables[b], wants_logits[b].
    tokens, positions: (R, C) long, the model's input (pad cells: token 0 at position 0,
    never written to the pool); logits come out at the last column, and its first
    num_logits rows are those of the sequences that want logits, in order.
    """

    def __init__(
        self,
        new_tokens: list[list[int]],
        num_computed: list[int],
        block_tables: list[list[int]],
        wants_logits: list[bool],
        block_size: int,
        device: torch.device,
    ) -> None:
        R, C, cells = pack([len(ids) for ids in new_tokens], wants_logits)
        tokens, positions = [0] * (R * C), [0] * (R * C)
        write_cells, write_slots = [], []  # each new token: its grid cell, its pool slot
        for ids, start, table, row_cells in zip(
            new_tokens, num_computed, block_tables, cells, strict=True
        ):
            row_positions = range(start, start + len(ids))
            for cell, token, position in zip(row_cells, ids, row_positions, strict=True):
                tokens[cell], positions[cell] = token, position
            write_cells += row_cells
            write_slots += [
                table[p // block_size] * block_size + p % block_size for p in row_positions
            ]
        self.num_logits = sum(wants_logits)
        self.tokens = torch.tensor(tokens, device=device).view(R, C)
        self.positions = torch.tensor(positions, device=device).view(R, C)
        self.write_cells = torch.tensor(write_cells, device=device)  # (N,)
        self.write_slots = torch.tensor(write_slots, device=device)  # (N,)

        by_length: dict[int, list[int]] = {}
        for b, ids in enumerate(new_tokens):
            by_length.setdefault(len(ids), []).append(b)
        histories = [start + len(ids) for start, ids in zip(num_computed, new_tokens, strict=True)]
        self.groups = [
            Group(
                [cells[b] for b in rows],
                [num_computed[b] for b in rows],
                [block_tables[b] for b in rows],
                block_size,
                device,
            )
            for same_length in by_length.values()
            for rows in split_by_history(same_length, histories, block_size)
        ]


def split_by_history(rows: list[int], histories: list[int], block_size: int) -> list[list[int]]:
    """The rows of one group, sorted by history length and cut in two where that spares
    the most padded keys (a group's histories are padded to its longest, in whole blocks),
    then each part again, as long as a cut spares at least SPLIT_KEYS keys.

    32 decode rows with histories of 150 to 600 tokens read 18,944 keys as one group,
    15,360 as two: on CPU their attention takes 59 ms per step instead of 90 (30 layers).
    """
    rows = sorted(rows, key=lambda b: histories[b])
    widths = [-(-histories[b] // block_size) for b in rows]  # blocks, ascending
    G = len(rows)
    padded = [i * widths[i - 1] + (G - i) * widths[-1] for i in range(1, G)]  # cut before i
    if not padded or (G * widths[-1] - min(padded)) * block_size < SPLIT_KEYS:
        return [rows]
    cut = padded.index(min(padded)) + 1
    return split_by_history(rows[:cut], histories, block_size) + split_by_history(
        rows[cut:], histories, block_size
    )


class Group:
    """The sequences of one step that add the same number L of new tokens: where their
    queries sit in the grid and where their histories sit in the pool.

    cells: (G, L) flat grid cells of each sequence's new tokens; tables: (G, W) block
    tables padded with block 0. A history is read as whole blocks, S = W * block_size
    keys; key_positions (G, S) gives each key's position, -1 past the sequence's history.
    When every history of the group is equally long, S is cut to that length and the
    bottom-right causal rule says all (mask "causal": the fast paths of sdpa).
    """

    def __init__(
        self,
        cells: list[list[int]],
        num_computed: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> None:
        G, L = len(cells), len(cells[0])
        width = max(len(table) for table in block_tables)
        totals = [start + L for start in num_computed]  # history length after this step
        self.num_new = L
        self.equal_lengths = len(set(totals)) == 1
        self.length = totals[0] if self.equal_lengths else width * block_size  # S
        self.block_size = block_size
        self.cells = torch.tensor(cells, device=device)  # (G, L)
        self.tables = torch.tensor(
            [table + [0] * (width - len(table)) for table in block_tables], device=device
        )  # (G, W)
        keys = torch.arange(self.length).expand(G, -1)  # (G, S)
        self.key_positions = torch.where(keys < torch.tensor(totals)[:, None], keys, -1).to(device)
        self.query_positions = (torch.tensor(num_computed)[:, None] + torch.arange(L)).to(device)
        self._masks: dict[tuple[int | None, bool], torch.Tensor] = {}
        self._value_rows: dict[tuple[int, int], torch.Tensor] = {}

    def history(self, pool: torch.Tensor) -> torch.Tensor:
        """The group's histories in one layer's pool (slots, Hkv, D) -> (G, S, Hkv, D), read
        as whole blocks: one row of block_size * Hkv * D values per block."""
        slots, Hkv, D = pool.shape
        blocks = pool.view(slots // self.block_size, self.block_size * Hkv * D)
        history = F.embedding(self.tables, blocks)  # (G, W, block_size * Hkv * D)
        return history.view(len(self.tables), -1, Hkv, D)[:, : self.length]

    def mask(self, window: int | None) -> Mask:
        """(G, 1, L, S) boolean, True = may attend: causal over each sequence's own history,
        inside `window`; or "causal" when that is all it says."""
        if self.equal_lengths and window is None:
            return "causal"
        return self._mask(window, additive=False)

    def score_mask(self, window: int | None) -> torch.Tensor:
        """`mask` as (G, 1, L, S) fp32 to add to scores: 0 where allowed, -inf elsewhere."""
        return self._mask(window, additive=True)

    def _mask(self, window: int | None, additive: bool) -> torch.Tensor:
        if (window, additive) not in self._masks:
            allowed = position_mask(self.query_positions, self.key_positions, window)
            if additive:
                zeros = torch.zeros(allowed.shape, device=allowed.device)
                allowed = zeros.masked_fill(~allowed, float("-inf"))
            self._masks[window, additive] = allowed
        return self._masks[window, additive]

    def value_rows(self, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        """(G * Hq, S): for query head h of each sequence, the row of the values viewed as
        (slots * Hkv, D) that it reads at each key: slot * Hkv + h // (Hq / Hkv)."""
        key = (num_heads, num_kv_heads)
        if key not in self._value_rows:
            G, W = self.tables.shape
            offsets = torch.arange(self.block_size, device=self.tables.device)
            slots = (self.tables[:, :, None] * self.block_size + offsets).view(G, -1)
            slots = slots[:, : self.length]  # (G, S)
            kv_head = torch.arange(num_heads, device=slots.device) // (num_heads // num_kv_heads)
            rows = slots[:, None, :] * num_kv_heads + kv_head[None, :, None]  # (G, Hq, S)
            self._value_rows[key] = rows.view(G * num_heads, -1)
        return self._value_rows[key]


class PagedCache:
    """One layer's cache over a `KVPool`, for the token grid of a `StepLayout`.

    It answers `attend`, the one call the attention layer makes (`qinfer.kv_cache.Attends`),
    and not the seed's update_and_fetch: a packed grid has no (B, Hkv, S, D) history to
    hand back. Decode groups attend with this module's own code (the contract of
    `scaled_dot_product_attention_grouped`), chunks with the layer's `sdpa`.
    """

    def __init__(self, pool: KVPool, layer: int, layout: StepLayout, window: int | None) -> None:
        self.keys, self.values = pool.keys[layer], pool.values[layer]  # (slots, Hkv, D)
        self.layout = layout
        self.window = window

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        mask: Mask,
        sdpa: Sdpa,
    ) -> torch.Tensor:
        """q (R, Hq, C, D) and the new k, v (R, Hkv, C, D) of the layout's grid -> (R, Hq, C, D)
        in q's dtype. Stores k, v into the pool, then attends each group of sequences to its
        own histories. mask: None or "causal" (the layout knows the real one)."""
        if isinstance(mask, torch.Tensor):
            raise CacheError("the paged cache masks by position; it takes no mask tensor")
        R, Hq, C, D = q.shape
        # Token-major, in the order of the grid's flat cells: (R * C, H, D)
        q, k, v = (x.transpose(1, 2).reshape(R * C, x.shape[1], D) for x in (q, k, v))
        layout = self.layout
        self.keys[layout.write_slots] = k[layout.write_cells].to(self.keys.dtype)
        self.values[layout.write_slots] = v[layout.write_cells].to(self.values.dtype)
        out = torch.zeros_like(q)  # pad cells stay 0
        for group in layout.groups:
            queries = q[group.cells]  # (G, L, Hq, D)
            if group.num_new == 1:
                out[group.cells] = self._decode(queries, group, scale)
            else:
                out[group.cells] = self._chunk(queries, group, scale, sdpa)
        return out.view(R, C, Hq, D).transpose(1, 2)

    def _decode(self, q: torch.Tensor, group: Group, scale: float) -> torch.Tensor:
        """q (G, 1, Hq, D), one token per sequence -> (G, 1, Hq, D).

        softmax(q k^T * scale + mask) v as `scaled_dot_product_attention_grouped` defines it
        (fp32 scores, weights cast to the values' dtype), without copying the values.
        """
        G, _, Hq, D = q.shape
        Hkv = self.keys.shape[1]
        # (G, S, Hkv, D) -> fp32 (G, Hkv, S, D), transposed and converted in one copy
        keys = group.history(self.keys).transpose(1, 2)
        keys = keys.to(torch.float32, memory_format=torch.contiguous_format)
        queries = q.reshape(G, Hkv, Hq // Hkv, D).float()  # query head h reads KV head h // n_rep
        scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale  # (G, Hkv, n_rep, S)
        weights = torch.softmax(scores + group.score_mask(self.window), dim=-1)
        # Row (g, h): sum over s of weights[g, h, s] * value row value_rows[g, h, s].
        out = F.embedding_bag(
            group.value_rows(Hq, Hkv),
            self.values.view(-1, D),  # (slots * Hkv, D)
            per_sample_weights=weights.view(G * Hq, -1).to(self.values.dtype),
            mode="sum",
        )  # (G * Hq, D)
        return out.view(G, 1, Hq, D).to(q.dtype)

    def _chunk(self, q: torch.Tensor, group: Group, scale: float, sdpa: Sdpa) -> torch.Tensor:
        """q (G, L, Hq, D), L new tokens per sequence -> (G, L, Hq, D), through `sdpa`."""
        keys = group.history(self.keys).transpose(1, 2)  # (G, Hkv, S, D)
        values = group.history(self.values).transpose(1, 2)
        out = sdpa(q.transpose(1, 2), keys, values, scale, group.mask(self.window))
        return out.transpose(1, 2)  # (G, Hq, L, D) -> (G, L, Hq, D)
