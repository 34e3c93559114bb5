"""Which snapshot rows of the recurrent-state pool hold which cached prefix's state.

A hybrid model's prefix cache (`engine.block_manager`) can only skip a prefix whose
Gated DeltaNet state it holds: a copy of a sequence's state after exactly those tokens,
kept in a snapshot row of the runner's `StatePool`. This index names, for the content id
of a prefix's last block (equal for equal prefixes: `BlockPool.register`), the row holding
the state after it.

Rows are few (each costs as much as ~100 KV blocks: the pool's docstring), so they are
given up in an order that keeps the ones likely to serve: a snapshot is *shared* once a
prompt diverged from another there or a hit used it, else *tentative* (a prompt's end,
which only a repeat or a continuation of that prompt finds). A new snapshot takes a free
row, else the least recently used tentative one's; a shared one may also take the least
recently used shared one's. So the ends of prompts that are never sent again cannot push
out a system prompt's state.

A row moves through three states: free, reserved for a step that ends a sequence at a
snapshot point (`reserve`: the runner copies the state in after that step), then holding
that prefix's state (`bind`). A reserved row is nobody else's until bound or released.
`generation` counts a row's reservations, so that the disk tier's writer thread, which
copies a held row out while steps run, can tell that the row was taken for another prefix
meanwhile (`qinfer.engine.disk_cache`).
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    """The snapshot rows `rows` of the state pool and the prefixes they hold."""

    def __init__(self, rows: range) -> None:
        self._free = list(reversed(rows))  # popped from the end: the first row first
        # content id of a prefix's last block -> its row, least recently used first
        self._tentative: OrderedDict[int, int] = OrderedDict()
        self._shared: OrderedDict[int, int] = OrderedDict()
        self.generation = dict.fromkeys(rows, 0)  # row -> how often it was reserved

    def __len__(self) -> int:
        """Prefixes whose state a row holds."""
        return len(self._tentative) + len(self._shared)

    def holds(self, content_id: int) -> bool:
        return content_id in self._tentative or content_id in self._shared

    def row_of(self, content_id: int) -> int | None:
        """The row holding this prefix's state, or None; its use not counted (not a hit)."""
        return self._tentative.get(content_id, self._shared.get(content_id))

    def find(self, content_id: int) -> int:
        """The row holding this prefix's state (a hit: now shared, the most recently used)."""
        if content_id in self._tentative:
            self._shared[content_id] = self._tentative.pop(content_id)
        self._shared.move_to_end(content_id)
        return self._shared[content_id]

    def reserve(self, shared: bool) -> int | None:
        """A row for a state about to be saved: a free one, else the least recently used
        tentative prefix's, else (for a shared one) the least recently used shared
        prefix's, forgotten; None when there is none to take."""
        row = None
        if self._free:
            row = self._free.pop()
        else:
            for held in (self._tentative, self._shared) if shared else (self._tentative,):
                if held:
                    row = held.popitem(last=False)[1]
                    break
        if row is not None:
            self.generation[row] += 1
        return row

    def bind(self, row: int, content_id: int, shared: bool) -> None:
        """A reserved row now holds this prefix's state (its step ran); given back if a
        row holds that prefix already (the same prefix computed twice at once: that one is
        then shared if this one would be)."""
        if self.holds(content_id):
            self._free.append(row)
            if shared:
                self.find(content_id)
        else:
            (self._shared if shared else self._tentative)[content_id] = row

    def release(self, row: int) -> None:
        """Give back a reserved row whose step did not run (its sequence was freed)."""
        self._free.append(row)

    def forget(self) -> int:
        """Forget every prefix held (their rows become free); how many there were."""
        count = len(self)
        for held in (self._tentative, self._shared):
            self._free += held.values()
            held.clear()
        return count
