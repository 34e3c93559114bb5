"""Block spaces: which layers' K/V share a block table, and how much of a history each keeps.

A full-attention layer reads the whole history of its sequence; a sliding-window layer
(window W) reads only the W positions up to each query: a query at position q reads keys
q - W + 1 .. q (`kv_cache.position_mask`). Once a step's queries start at position c (the
tokens already computed), no query of this or a later step reads a position below
c - W + 1, so the blocks wholly below it go back to the pool (after each step,
`BlockManager.register_computed`). The layers of a model are therefore split into block
spaces, each with a `KVPool` over its own layers, a `BlockPool` of its own (who holds which
block, `qinfer.engine.block_manager`), and one block table per sequence:

- a model without sliding layers: one space, whole histories (every layer of the model);
- full-attention and sliding layers (Gemma 3, Qwen2 with max_window_layers): space 0 holds
  the full-attention layers and whole histories (`Sequence.tables[0]`), space 1 the
  sliding layers and only the blocks of each sequence's window (`Sequence.tables[1]`);
- every layer slides (Mistral v0.1, Phi-3): one space that keeps only the window.

A window space's table keeps its logical indices (entry i holds positions i * B ..
(i + 1) * B - 1); the entries of released blocks are `NULL_BLOCK`. A step reads a window
space's table from `first_block(num_computed, window, B)` on: never a released entry.

A speculative draft model addresses its own pool with space 0's tables (`qinfer.engine.speculative
.draft`): those must hold whole histories, so a model whose every layer slides keeps them
when a draft model drafts for it (`whole_space_0`).

All sliding layers of a model share one window (`ModelConfig.sliding_window`).
"""

from __future__ import annotations

from dataclasses import dataclass

from qinfer.core.errors import ConfigError
from qinfer.core.model_config import ModelConfig

#: A window table's entry whose block was released (before every query's window).
NULL_BLOCK = -1


@dataclass(frozen=True)
class BlockSpaces:
    """How one model's layers split over block spaces.

    windows[s]: space s's window in tokens (None: it keeps whole histories).
    layers[l]: (s, i): layer l's K/V are layer i of space s's pool; None for a layer that
    keeps no K/V (a hybrid model's linear attention: its state is the state pool's,
    `qinfer.attention.state_pool`).
    layer_windows[l]: layer l's own attention window (what its mask says; a layer of a
    whole-history space may still slide, masked to its window).
    """

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, int] | None, ...]
    layer_windows: tuple[int | None, ...]

    @classmethod
    def whole(cls, config: ModelConfig) -> BlockSpaces:
        """One space holding whole histories for every attention layer (sliding layers
        masked to their window): a draft model's pool, or a model without sliding layers."""
        count = range(config.num_hidden_layers)
        layer_windows = tuple(config.window(layer) for layer in count)
        attending = [layer for layer in count if not config.linear(layer)]
        layers = tuple((0, attending.index(i)) if i in attending else None for i in count)
        return cls((None,), layers, layer_windows)

    @classmethod
    def of(cls, config: ModelConfig, whole_space_0: bool = False) -> BlockSpaces:
        """The model's spaces: full-attention layers in space 0, sliding ones in a space of
        their window (the only one when every layer slides, unless whole_space_0 asks
        space 0 to keep whole histories: a draft model reads them)."""
        spaces = cls.whole(config)
        kinds = [w for w, held in zip(spaces.layer_windows, spaces.layers, strict=True) if held]
        windows = sorted({w for w in kinds if w is not None})
        if len(windows) > 1:
            raise ConfigError(f"sliding layers of one model must share a window, got {windows}")
        if not windows or (whole_space_0 and None not in kinds):
            return spaces
        window_space = 1 if None in kinds else 0
        space_of = [0 if w is None else window_space for w in kinds]
        held = iter((s, space_of[:i].count(s)) for i, s in enumerate(space_of))
        layers = tuple(None if where is None else next(held) for where in spaces.layers)
        space_windows = (None, windows[0]) if window_space else (windows[0],)
        return cls(space_windows, layers, spaces.layer_windows)

    def num_layers(self, space: int) -> int:
        """The layers whose K/V live in `space`."""
        return sum(where is not None and where[0] == space for where in self.layers)


def first_block(num_computed: int, window: int | None, block_size: int) -> int:
    """The first block a step whose queries start at position `num_computed` reads in a
    space of this window: the one holding position num_computed - window + 1 (0 for whole
    histories). Every block before it can be released."""
    if window is None:
        return 0
    return max(0, (num_computed - window + 1) // block_size)


def window_space_blocks(
    window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, proposed: int
) -> int:
    """The most blocks the running sequences hold together in a window space.

    A sequence whose step runs n tokens from position c holds the blocks from
    `first_block(c)` to position c + m - 1, m = max(n, 1 + proposed) (a draft model's
    proposals are given blocks before the step; rejected ones leave theirs): at most
    floor((window + m - 3) / B) + 2 <= ceil((window + m) / B) + 1 blocks. Summed over
    max_num_seqs sequences whose steps run max_num_batched_tokens at most:
    max_num_seqs * (ceil(window / B) + ceil(proposed / B) + 2) + ceil(tokens / B)."""
    per_sequence = -(-window // block_size) + -(-proposed // block_size) + 2
    return max_num_seqs * per_sequence + -(-max_num_batched_tokens // block_size)
