"""Run-time feature switches that change how a layer computes, never what it computes."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Features:
    """Switches passed to every layer (the seed's `features` argument).

    fast_sdpa: compute attention with `torch.nn.functional.scaled_dot_product_attention`
        (fused kernels on CPU and CUDA) instead of the explicit reference in
        `layers/attention.py`. Both give the same result; the tests hold them to it.
    """

    fast_sdpa: bool = True
