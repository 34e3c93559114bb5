"""The paged attention backend: every sequence's K/V in one pool of blocks (`KVPool`).

One engine step is one forward, whatever mix of decode tokens and prompt chunks it holds:
the new tokens of all its sequences, flat (T tokens, `ForwardBatch`), each with its own
position. Only attention cares which sequence a token belongs to, and `PagedAttention.attend`
(one layer) sorts that out: it writes the step's K/V into their slots in the pool, then
attends the queries of each group of sequences adding the same number of new tokens to
their own histories:

- decode (one new token each): the keys are copied as whole blocks (one row of
  block_size * D values per block and head, not one per token), scores and softmax are fp32
  as in every attention path, and the weighted sum of the values is one `embedding_bag`
  that reads each value row where it sits in the pool: the values are never copied. A
  sequence decodes this way alone and in any group: padding a group's histories to its
  longest adds keys of weight exactly 0, so a row's attention is the same whatever else
  runs beside it (a lone sequence used to take torch's fused sdpa, whose other reduction
  order made its tokens differ from the same sequence's in a batch);
- a decode step on a CPU (`PagedBackend.decode_kernel`; fp32, bf16 or int8 pools): one
  compiled op a layer (`kernels.paged_decode_attention`) stores the step's K/V (an int8
  pool's quantized as `store_kv` quantizes them) and attends each query over its own table,
  its history alone, in fp32 with sums in key order: no group, no padding, no copy, and the same
  output for a sequence alone and in any step;
- chunks (several new tokens each): keys and values copied as whole blocks, then the
  step's sdpa; or, batch-invariant (`Features.batch_invariant`), the decode arithmetic
  for every query, with fp64 scores, so that a token's output is the same in a chunk of
  any length as at decode.

A quantized pool (int8 or fp8, `qinfer.attention.kv_quant`) takes the step's K/V quantized per block
of each token's head vector, one op chain per layer for all its tokens, and gives back only
what attention reads: the gathered histories, dequantized in the copy that converts them
(decode values too: torch's embedding_bag reads no int8 or fp8), where the decode op (which
dequantizes an int8 pool's blocks as it reads them) does not attend. An unquantized pool
takes none of these steps.

A group's histories are padded to its longest (in whole blocks) and masked by position.

Block spaces (`qinfer.attention.block_spaces`): a model with sliding-window layers keeps
their K/V in a pool of their own, whose tables hold only each sequence's window (the
blocks before it go back to the pool). The step's plan is then two `_SpacePlan`s, one per space,
each with its own slots and tables, and each layer reads its space's: a sliding layer's
history starts at its table's first block (a decode reads at most ceil(window / B) + 1
blocks, however long the sequence), its keys placed by position (key_starts) for the mask.
"""

from __future__ import annotations

from functools import cached_property

import torch

from qinfer import kernels
from qinfer.attention.kv_cache import position_mask
from qinfer.attention.kv_pool import KVLayout, LayerKV, PagedLayer, store_kv
from qinfer.attention.kv_quant import KVFormat
from qinfer.attention.sdpa import Mask, Sdpa
from qinfer.core.forward_batch import ForwardBatch, SpaceTensors

#: Padded keys a cut must spare for a group to be split in two (`split_by_history`): on
#: CPU one more group per layer costs about what ~1000 keys cost (SmolLM2-135M, bf16).
SPLIT_KEYS = 1024


class _SpacePlan:
    """Where the K/V of one step's tokens go to and come from in one block space's pool:
    the metadata that every layer of that space shares, built once per step from the
    step's `ForwardBatch` (views of the runner's `StepBuffers`, written in place; `space`
    names this space's part). The host lists decide the grouping.

    Per sequence b: num_new[b] tokens run now (flat, sequence after sequence),
    num_computed[b] tokens already in the pool (at positions 0..num_computed[b]-1),
    its table: its blocks in this space, from the step's first block on (see
    `StepBuffers.write`). slots: (T,) the pool slot each new token's K/V is written to.
    """

    def __init__(self, tensors: ForwardBatch, space: int = 0) -> None:
        part = tensors.spaces[space]
        self.tensors, self.part = tensors, part
        self.slots, self.block_size = part.slots, tensors.block_size  # (T,)
        # A decode step (one new token per sequence) as the compiled op reads it, whatever
        # the grouping: each token's position and its sequence's table (S, W), history
        # length (S,) and first key's position (S,) or None. Such a step never builds its
        # groups (below, on first use): it does no host work but this test.
        self.decode_only = set(tensors.num_new) == {1}
        self.positions, self.tables = tensors.positions, part.block_tables
        self.totals, self.key_starts = tensors.context_lens, part.key_starts

    @cached_property
    def histories(self) -> list[int]:
        """The keys each sequence reads: its history, less the blocks before its table's
        first."""
        tensors, first_blocks = self.tensors, self.part.first_blocks
        histories = [c + n for c, n in zip(tensors.num_computed, tensors.num_new, strict=True)]
        if first_blocks is None:
            return histories
        return [
            h - first * self.block_size for h, first in zip(histories, first_blocks, strict=True)
        ]

    @cached_property
    def groups(self) -> list[_Group]:
        """The sequences grouped by new tokens, then split by history (`split_by_history`)."""
        num_new, histories = self.tensors.num_new, self.histories
        by_length: dict[int, list[int]] = {}
        for b, n in enumerate(num_new):
            by_length.setdefault(n, []).append(b)
        return [
            _Group(
                rows,
                num_new[rows[0]],
                histories,
                self.part.tables,
                self.block_size,
                self.tensors,
                self.part,
            )
            for same_length in by_length.values()
            for rows in split_by_history(same_length, histories, self.block_size)
        ]

    @cached_property
    def in_order(self) -> bool:
        """One group whose sequences keep the step's order: its queries are the step's
        tokens as they are (a decode step of equal or close histories, a single prompt
        chunk)."""
        return len(self.groups) == 1 and sorted(self.histories) == self.histories


def split_by_history(rows: list[int], histories: list[int], block_size: int) -> list[list[int]]:
    """The rows of one group, sorted by history length and cut in two where that spares
    the most padded keys (a group's histories are padded to its longest, in whole blocks),
    then each part again, as long as a cut spares at least SPLIT_KEYS keys.

    (What a cut spares: docs/BENCHMARKS.md, "Splitting decode groups by history".)
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


class _Group:
    """The sequences of one step that add the same number L of new tokens: where their
    queries sit in the step and where their histories sit in one space's pool.

    rows: the group's sequences (indices into the step's); lengths[b]: the keys sequence b
    reads (its history after the step, less the positions before its table's first
    block). tables: (G, W) their block tables padded with block 0. A history is read as
    whole blocks, S = W * block_size keys; key_positions (G, S) gives each key's position,
    -1 past the sequence's history. When every history of a group of prompt chunks is
    equally long, S is cut to that length and, within the window, the bottom-right causal
    rule says all (mask "causal": the fast paths of sdpa). What only some paths read (the queries' flat
    indices, the masks, the value rows) is made on first use, once per step.
    """

    def __init__(
        self,
        rows: list[int],
        num_new: int,
        lengths: list[int],
        block_tables: list[list[int]],
        block_size: int,
        tensors: ForwardBatch,
        space: SpaceTensors,
    ) -> None:
        G, L = len(rows), num_new
        width = max(len(block_tables[b]) for b in rows)
        read = [lengths[b] for b in rows]  # keys each sequence reads
        self.rows, self.num_new, self.block_size = rows, L, block_size
        self.starts = [tensors.query_starts[b] for b in rows]  # each one's first new token
        equal_lengths = len(set(read)) == 1
        # S, the keys read: a prompt chunk's exact history when the group's are equally long
        # (the causal rule is then the whole mask: sdpa's fast paths); whole blocks at decode,
        # so that a sequence's scores come from a GEMM of the same width of keys alone as
        # beside longer histories (fp32 GEMMs order a partial tile's sums otherwise: scores
        # 1e-6 apart on an AMD EPYC, and greedy tokens that differ after a few dozen steps)
        self.length = read[0] if equal_lengths and L > 1 else width * block_size
        self.whole = equal_lengths and self.length == read[0]  # no key past a history
        self._tensors = tensors
        self.key_starts = space.key_starts  # (G,) position of each first key, or None: 0
        if rows == list(range(len(tensors.query_starts) - 1)):  # every sequence, in order
            self.tables = space.block_tables[:, :width]  # (G, W) views of the buffers
            self.totals = tensors.context_lens  # (G,)
        else:
            index = torch.tensor(rows, device=space.block_tables.device)
            self.tables = space.block_tables[index, :width]
            self.totals = tensors.context_lens[index]
            if self.key_starts is not None:
                self.key_starts = self.key_starts[index]
        self._masks: dict[tuple[int | None, bool], torch.Tensor] = {}
        self._value_rows: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._block_rows: dict[tuple[int, int], torch.Tensor] = {}
        # A lone sequence whose blocks follow each other in the pool (as a fresh pool hands
        # them out) reads its history as a slice of the pool, without a copy.
        table = block_tables[rows[0]]
        first = table[0] if table else 0
        run = list(range(first, first + len(table)))
        self.first_slot = first * block_size if G == 1 and table == run else None

    @cached_property
    def tokens(self) -> torch.Tensor:
        """(G, L) flat indices of each sequence's new tokens in the step."""
        starts = torch.tensor(self.starts, device=self.tables.device)
        return starts[:, None] + torch.arange(self.num_new, device=starts.device)

    @cached_property
    def key_positions(self) -> torch.Tensor:
        """(G, S): each key's position in its sequence, -1 past its history."""
        keys = torch.arange(self.length, device=self.tables.device).expand(len(self.rows), -1)
        if self.key_starts is not None:  # a window space's tables start past position 0
            keys = keys + self.key_starts[:, None]
        return torch.where(keys < self.totals[:, None], keys, -1)

    @cached_property
    def query_positions(self) -> torch.Tensor:
        """(G, L): each new token's position."""
        return self._tensors.positions[self.tokens]

    def history(self, pool: torch.Tensor) -> torch.Tensor:
        """The group's histories in one layer's pool (Hkv, slots, D) -> (G, Hkv, S, D), read
        as whole blocks: one row of block_size * D values per block and head (or a view of
        the pool when they lie in one run). Batched over (G, Hkv) as a view: every
        (sequence, head)'s S keys are consecutive rows."""
        if self.first_slot is not None:
            return pool[:, self.first_slot : self.first_slot + self.length][None]
        Hkv, slots, D = pool.shape
        # index_select over dim 0 copies whole rows; over another dim, or indexing with a
        # (G, W) tensor, it gathers element by element (docs/BENCHMARKS.md, "Gathering
        # blocks")
        rows = self.block_rows(Hkv, slots // self.block_size)
        history = pool.view(-1, self.block_size * D).index_select(0, rows)
        return history.view(len(self.rows), Hkv, -1, D)[:, :, : self.length]

    def block_rows(self, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
        """(G * Hkv * W,) the rows of a pool viewed as (Hkv * num_blocks, block_size * D)
        that hold the group's blocks, sequence by sequence, head by head, then in table
        order: head h's block n is row h * num_blocks + n."""
        key = (num_kv_heads, num_blocks)
        if key not in self._block_rows:
            heads = torch.arange(num_kv_heads, device=self.tables.device) * num_blocks
            self._block_rows[key] = (heads[None, :, None] + self.tables[:, None, :]).reshape(-1)
        return self._block_rows[key]

    def mask(self, window: int | None) -> Mask:
        """(G, 1, L, S) boolean, True = may attend: causal over each sequence's own history,
        inside `window`; or "causal" when that is all it says."""
        if self.causal_only(window):
            return "causal"
        return self._mask(window, additive=False)

    def causal_only(self, window: int | None) -> bool:
        """True when the S keys are each sequence's whole read history (positions
        consecutive up to its last) and inside the window: the bottom-right causal rule
        is then the whole mask."""
        return self.whole and (window is None or self.length <= window)

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

    def value_rows(
        self, num_heads: int, num_kv_heads: int, num_slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The bags `_decode`'s embedding_bag reads: (G * Hq * S,) value rows, and the
        (G * Hq,) offsets where each bag starts. Bag (g, h), for query head h of sequence g,
        holds the row of the values viewed as (Hkv * slots, D) that h reads at each key:
        (h // (Hq / Hkv)) * slots + slot."""
        key = (num_heads, num_kv_heads, num_slots)
        if key not in self._value_rows:
            G, W = self.tables.shape
            # each block's row of block_size * D values is block_size rows of D
            blocks = self.block_rows(num_kv_heads, num_slots // self.block_size)
            offsets = torch.arange(self.block_size, device=blocks.device)
            rows = (blocks.view(G, num_kv_heads, W, 1) * self.block_size + offsets).view(
                G, num_kv_heads, -1
            )[:, :, : self.length]  # (G, Hkv, S)
            rows = rows.repeat_interleave(num_heads // num_kv_heads, dim=1)  # (G, Hq, S)
            starts = torch.arange(0, rows.numel(), self.length, device=rows.device)
            self._value_rows[key] = rows.reshape(-1), starts
        return self._value_rows[key]


class PagedBackend:
    """The paged CPU backend (`qinfer.attention.backend`): pools laid out heads first, a
    step's metadata as `_SpacePlan`s (one per block space), `PagedAttention` to attend.

    sdpa: the attention function of prompt chunks; invariant: every query through the
    decode arithmetic (`Features.batch_invariant`); decode_kernel: decode steps through the
    compiled op (`kernels.paged_decode_attention`: CPU pools of fp32, bf16 or int8 K/V, as
    `choose_backend` decides by the pool's format, queries of fp32 or bf16; not with
    invariant, whose fp64 arithmetic a chunk must share)."""

    layout = KVLayout.HEADS_FIRST

    def __init__(self, sdpa: Sdpa, invariant: bool = False, decode_kernel: bool = False) -> None:
        self.sdpa, self.invariant = sdpa, invariant
        self.decode_kernel = decode_kernel and not invariant
        # A decode step through the op reads only the step's tensors (`_SpacePlan`); any
        # other is grouped by history on the host, step by step.
        self.static_decode = self.decode_kernel

    def plan(self, step: ForwardBatch, layers: list[PagedLayer]) -> PagedAttention:
        """The step's attention over the pools that `layers` place."""
        paged = [_SpacePlan(step, space) for space in range(len(step.spaces))]
        return PagedAttention(layers, paged, self.sdpa, self.invariant, self.decode_kernel)


class PagedAttention:
    """The attention of one step over the pools of a model's block spaces: `attend` for
    each layer in turn.

    layers[l]: where layer l's K/V live (`paged_layers`); steps[s]: this step's
    `_SpacePlan` over block space s's pool; sdpa: the attention function of prompt chunks
    (decode groups use this module's own, which reads the values where they sit). Both
    answer `scaled_dot_product_attention_grouped`'s contract. invariant: every query,
    decode or chunk, through `_decode`'s invariant arithmetic (`Features.batch_invariant`).
    decode_kernel: every decode token (a step's, or beside prompt chunks) through the
    compiled op (`PagedBackend`).
    """

    def __init__(
        self,
        layers: list[PagedLayer],
        steps: list[_SpacePlan],
        sdpa: Sdpa,
        invariant: bool = False,
        decode_kernel: bool = False,
    ) -> None:
        self.layers, self.steps = layers, steps
        self.sdpa, self.invariant, self.decode_kernel = sdpa, invariant, decode_kernel

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q (T, Hq, D) and the new k, v (T, Hkv, D) -> (T, Hq, D) in q's dtype. Stores k, v
        into the layer's pool, then attends each group of sequences to its own histories."""
        kv, space, window = self.layers[layer]
        step = self.steps[space]
        if self.decode_kernel and step.decode_only:
            # one new token per sequence: stored (an int8 pool's quantized as `store_kv`
            # does) and attended in one compiled op (`kernels.paged_decode_attention`), the
            # step's views as they are
            return kernels.paged_decode_attention(
                *(q, k, v, kv.keys, kv.values, step.slots, step.positions, step.tables),
                *(step.totals, step.key_starts, step.block_size, window, scale),
                *(kv.key_scales, kv.value_scales),
            )
        store_kv(kv, step.slots, k, v)
        if step.in_order:  # one group holding the tokens in order: no gather, no scatter
            (group,) = step.groups
            queries = q.view(len(group.rows), group.num_new, *q.shape[1:])  # (G, L, Hq, D)
            return self._group(queries, kv, group, window, scale).reshape(q.shape)
        out = torch.empty_like(q)  # every token belongs to exactly one group
        for group in step.groups:
            queries = q[group.tokens]  # (G, L, Hq, D)
            out[group.tokens] = self._group(queries, kv, group, window, scale)
        return out

    def _group(
        self, q: torch.Tensor, kv: LayerKV, group: _Group, window: int | None, scale: float
    ) -> torch.Tensor:
        """q (G, L, Hq, D) of one group -> (G, L, Hq, D). Decode queries read the values in
        place (`_decode`), chunks go through sdpa on copied histories, or through `_decode`
        too where the step is to be batch-invariant."""
        if group.num_new == 1 and self.decode_kernel:
            # decode tokens beside prompt chunks: the same op as a decode step's, their K/V
            # stored already
            out = kernels.paged_decode_attention(
                *(q[:, 0], None, None, kv.keys, kv.values, None, group.query_positions[:, 0]),
                *(group.tables, group.totals, group.key_starts, group.block_size, window, scale),
                *(kv.key_scales, kv.value_scales),
            )
            return out[:, None]  # (G, 1, Hq, D)
        if group.num_new == 1 or self.invariant:
            return _decode(q, kv, group, window, scale, self.invariant)
        return _chunk(q, kv, group, window, scale, self.sdpa)


def _history(
    group: _Group,
    data: torch.Tensor,
    scales: torch.Tensor | None,
    fmt: KVFormat,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The group's histories of `data` (one layer's keys or values, stored as `fmt`) ->
    (G, Hkv, S, D) in `dtype`, dequantized with `scales` (Hkv, slots, N), gathered the
    same way."""
    history = group.history(data)
    if scales is None:
        return history if history.dtype == dtype else history.to(dtype)
    return fmt.dequantize(history, group.history(scales), dtype)


def _decode(
    q: torch.Tensor,
    kv: LayerKV,
    group: _Group,
    window: int | None,
    scale: float,
    invariant: bool = False,
) -> torch.Tensor:
    """q (G, L, Hq, D), L new tokens per sequence (1 at decode), against one layer's keys and
    values -> (G, L, Hq, D).

    softmax(q k^T * scale + mask) v as `scaled_dot_product_attention_grouped` defines it
    (fp32 scores, weights cast to the values' dtype). Unquantized values are read where
    they sit, without a copy; quantized ones are gathered and dequantized, as the keys
    are in the copy that widens them.

    invariant (`Features.batch_invariant`): scores and softmax in fp64, rounded once to the
    values' dtype, so that a query's weights do not depend on how many queries and keys its
    GEMM held (fp32 bmm blocks by both): with the values summed one row after another in
    key order, a token gets the same output at decode, in a prompt chunk of any length,
    and beside any other sequences.
    """
    G, L, Hq, D = q.shape
    Hkv, num_slots = kv.keys.shape[:2]
    n_rep, S = Hq // Hkv, group.length
    wide = torch.float64 if invariant else torch.float32
    # (G, Hkv, S, D) -> (G * Hkv, S, D) fp32: one copy converts (and dequantizes) a
    # gathered history (a view of an fp32 pool's gather is used as it is)
    history = _history(group, kv.keys, kv.key_scales, kv.format, wide).reshape(G * Hkv, S, D)
    # query head h reads KV head h // n_rep: (G, L, Hkv, n_rep, D) -> (G * Hkv, n_rep * L, D)
    queries = q.view(G, L, Hkv, n_rep, D)
    if L > 1:
        queries = queries.permute(0, 2, 3, 1, 4)
    # the scale goes on the queries, which hold fewer values than the scores (the two
    # orders differ by fp32 rounding only)
    queries = queries.reshape(G * Hkv, n_rep * L, D).to(wide) * scale
    scores = torch.bmm(queries, history.transpose(1, 2)).view(G, Hkv, n_rep, L, S)
    if L > 1 or not group.causal_only(window):  # else every key is visible: nothing to mask
        scores = scores + group.score_mask(window)[:, :, None]  # (G, 1, 1, L, S)
    weights = torch.softmax(scores, dim=-1)
    if kv.value_scales is not None:
        # gathered and multiplied as a matmul over the padded history: invariant, in fp64
        # (the padding's weights are 0) and rounded once, as the scores are
        summed = wide if invariant else q.dtype
        values = _history(group, kv.values, kv.value_scales, kv.format, summed)  # (G, Hkv, S, D)
        out = torch.matmul(weights.to(summed).view(G, Hkv, n_rep * L, S), values)
        return out.to(q.dtype).view(G, Hq, L, D).transpose(1, 2)  # (G, L, Hq, D)
    # Bag (g, h, l): sum over s of weights[g, h, l, s] * its value row at s (`value_rows`);
    # torch.embedding_bag itself, not F.embedding_bag, whose checks and 2-D handling
    # cost more than the op at decode sizes.
    rows, starts = group.value_rows(Hq, Hkv, num_slots)
    if L > 1:  # each query of a sequence's head reads the same rows
        rows = rows.view(G * Hq, 1, S).expand(-1, L, -1).reshape(-1)
        starts = torch.arange(0, rows.numel(), S, device=rows.device)
    out = torch.embedding_bag(
        kv.values.view(-1, D),  # (Hkv * slots, D)
        rows,
        starts,
        False,  # scale_grad_by_freq
        0,  # mode: sum
        False,  # sparse
        weights.reshape(-1).to(kv.values.dtype),  # per_sample_weights
    )[0]  # (G * Hq * L, D) in the values' dtype
    out = out.view(G, 1, Hq, D) if L == 1 else out.view(G, Hq, L, D).transpose(1, 2)
    return out if out.dtype == q.dtype else out.to(q.dtype)  # (a no-op `.to` costs a call)


def _chunk(
    q: torch.Tensor, kv: LayerKV, group: _Group, window: int | None, scale: float, sdpa: Sdpa
) -> torch.Tensor:
    """q (G, L, Hq, D), L new tokens per sequence -> (G, L, Hq, D), through `sdpa`."""
    history_k = _history(group, kv.keys, kv.key_scales, kv.format, q.dtype)  # (G, Hkv, S, D)
    history_v = _history(group, kv.values, kv.value_scales, kv.format, q.dtype)
    out = sdpa(q.transpose(1, 2), history_k, history_v, scale, group.mask(window))
    return out.transpose(1, 2)  # (G, Hq, L, D) -> (G, L, Hq, D)
