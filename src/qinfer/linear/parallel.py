"""Linears split across tensor-parallel ranks whose calls communicate.

A column-parallel projection (q/k/v, gate/up) needs no kind of its own: each rank holds a
plain Linear of its output rows. The two kinds here hold one rank's part of a weight and
join the ranks' results inside their call, so that `linear(x, w)` stays the layers' one
call and every collective of a forward happens in one of these methods:

- `RowParallelLinear.forward`: one all-reduce of (..., out_features) (o_proj, down_proj);
- `VocabParallelLinear.rows`: one all-reduce of (..., hidden) (the embedding lookup);
- `VocabParallelLinear.forward`: one all-gather of (..., vocab / N) (the logits).

They are built by the weights seam (`Weights.linear(..., shard=)`) only when the world has
more than one rank; a single process never sees them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qinfer.core.parallel import Parallel
from qinfer.linear.base import Linear


class RowParallelLinear(Linear):
    """y = all_reduce(x_r W_r^T) + b: this rank holds the columns W_r (out, in / N) and
    receives the matching slice x_r (..., in / N) of the input, which column-parallel layers
    before it left split; the partial sums are added across ranks, then the bias (replicated,
    (out,) or None) is added once."""

    def __init__(self, local: Linear, bias: torch.Tensor | None, parallel: Parallel) -> None:
        super().__init__()
        self.local, self.parallel = local, parallel
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = local.out_features, local.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parallel.all_reduce_sum(self.local(x))  # (..., out): every rank's sum
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        """This rank's columns (out, in / N) in fp32."""
        return self.local.dequantize()

    @property
    def nbytes(self) -> int:
        return self.local.nbytes + self._bias_nbytes()


class VocabParallelLinear(Linear):
    """The embedding table (and a tied or untied lm_head) split by vocabulary rows.

    The vocabulary V is padded to N * ceil(V / N); this rank holds the real rows `vocab` of
    its share (the last ranks' shares end with padding, which no id reaches).
    rows(ids): rows of the ids this rank holds, zeros for the others, all-reduced: every id's
        row comes from the one rank that has it.
    forward(x): this rank's logits, padded to the share, all-gathered in rank order and
        trimmed to V.
    """

    def __init__(self, local: Linear, vocab: range, vocab_size: int, parallel: Parallel) -> None:
        super().__init__()
        self.local, self.vocab, self.parallel = local, vocab, parallel
        self.bias = None
        self.out_features, self.in_features = vocab_size, local.in_features
        self.share = -(-vocab_size // parallel.world_size)  # ceil(V / N) rows per rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gathered(self.local(x))

    def logits(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's fp32 logits (`Linear.logits`), all-gathered as `forward`'s."""
        return self._gathered(self.local.logits(x, dtype))

    def _gathered(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., len(vocab)), this rank's ids -> (..., V), every rank's."""
        padding = self.share - self.local.out_features
        if padding:
            logits = F.pad(logits, (0, padding))  # (..., ceil(V / N))
        logits = self.parallel.all_gather_last_dim(logits)  # (..., N * ceil(V / N))
        return logits[..., : self.out_features]  # (..., V)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        local_ids = ids - self.vocab.start
        elsewhere = (local_ids < 0) | (local_ids >= len(self.vocab))  # ids another rank holds
        h = self.local.rows(local_ids.masked_fill(elsewhere, 0))  # (..., hidden)
        h = h.masked_fill(elsewhere[..., None], 0)
        return self.parallel.all_reduce_sum(h)  # (..., hidden): each id's row, on every rank

    def dequantize(self) -> torch.Tensor:
        """This rank's rows (len(vocab), in) in fp32."""
        return self.local.dequantize()

    @property
    def nbytes(self) -> int:
        return self.local.nbytes
