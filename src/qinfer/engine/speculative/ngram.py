"""Prompt lookup: the tokens that followed the sequence's last n tokens earlier on.

Editing, summarising with quotes, code changes and retrieval answers copy long runs of
their prompt. When the last n tokens (the longest n from prompt_lookup_max down to
prompt_lookup_min that matches) also occur earlier in the prompt or the output, the tokens
that followed that earlier occurrence are a good guess for what comes next; the model
verifies them for the price of a few more rows in its step. Nothing else is run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    token_ids (min_n .. max_n tokens long) found earlier in token_ids; [] when none is.

    The latest occurrence is taken: in a long prompt the nearest copy is the likeliest to
    continue the same way (an edited paragraph follows its source in order). One pass over
    the sequence finds where its last min_n tokens occurred; a longer suffix can only occur
    ending where those do, so longer matches are checked at those places only.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    length = len(ids)
    if length <= min_n:
        return []
    # (length - min_n, min_n): every window that starts before the suffix itself
    windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], min_n)
    ends = np.flatnonzero((windows == ids[-min_n:]).all(axis=1)) + min_n  # where each ends
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        found = ends[ends >= n]  # room for n tokens before the end
        if n > min_n and len(found):  # the n - min_n tokens before must match too
            before = ids[found[:, None] - n + np.arange(n - min_n)]  # (hits, n - min_n)
            found = found[(before == ids[-n:-min_n]).all(axis=1)]
        if len(found):
            start = int(found[-1])  # what followed the latest earlier occurrence
            return ids[start : start + k].tolist()
    return []
