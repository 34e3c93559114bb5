"""The building blocks of a decoder layer, one concept per module."""

from qinfer.attention.sdpa import scaled_dot_product_attention_grouped
from qinfer.layers.attention import Attention
from qinfer.layers.mlp import MLP
from qinfer.layers.norm import RMSNorm
from qinfer.layers.rope import RoPE
from qinfer.linear import Linear, linear

__all__ = [
    "MLP",
    "Attention",
    "Linear",
    "RMSNorm",
    "RoPE",
    "linear",
    "scaled_dot_product_attention_grouped",
]
