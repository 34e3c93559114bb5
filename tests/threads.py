"""torch's thread count for a block of a test: the suite's workers run one thread each
(tests/conftest.py), so a test that holds a result to the same bits across thread counts
names both counts instead of reading the default."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch.set_num_threads(count) inside the block, the previous count after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
