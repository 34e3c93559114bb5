"""The Linear family: every projection of the model is one callable `Linear`.

    y = linear(x, w)         # (..., in_features) -> (..., out_features)
    h = w.rows(token_ids)    # an embedding lookup in the same table: (...) -> (..., in_features)

Which kind a projection is (dense, int8 per channel, int8 blocks, int4 groups, or several of
them side by side) is decided once, where the weights are loaded (`qinfer.weights`); the
layers only ever call `linear(x, w)`. Quantizing a model is then a different `Linear`,
never a new model. Under tensor parallelism a rank holds part of each weight, and the
kinds in `parallel.py` join the ranks' results inside their call.
"""

from qinfer.linear.base import Linear, linear
from qinfer.linear.build import Int4Groups, Int8Blocks, Int8Rows, StoredWeight, make_linear
from qinfer.linear.concat import ConcatLinear
from qinfer.linear.dense import DenseLinear
from qinfer.linear.int4 import Int4Linear, int4_kernel_supports, quantize_int4
from qinfer.linear.int4_blocks import Int4BlockLinear
from qinfer.linear.int8 import Int8Linear, quantize_int8
from qinfer.linear.int8_blocks import Int8BlockLinear, quantize_int8_blocks
from qinfer.linear.parallel import RowParallelLinear, VocabParallelLinear

__all__ = [
    "ConcatLinear",
    "DenseLinear",
    "Int4BlockLinear",
    "Int4Groups",
    "Int4Linear",
    "Int8BlockLinear",
    "Int8Blocks",
    "Int8Linear",
    "Int8Rows",
    "Linear",
    "RowParallelLinear",
    "StoredWeight",
    "VocabParallelLinear",
    "int4_kernel_supports",
    "linear",
    "make_linear",
    "quantize_int4",
    "quantize_int8",
    "quantize_int8_blocks",
]
