"""Run-time switches: how a layer computes, how the K/V it keeps are stored, and the names
of the attention backends."""

from dataclasses import dataclass

from qinfer.core.errors import QinferError

#: The names `Features.kv_cache_dtype` (and `--kv-cache-dtype`) accepts; `qinfer.attention.kv_quant`
#: says how each stores K/V.
KV_CACHE_DTYPES = ("auto", "bf16", "int8", "fp8")


def check_kv_cache_dtype(name: str) -> None:
    """Refuse a name that is not one of KV_CACHE_DTYPES, in one line."""
    if name not in KV_CACHE_DTYPES:
        raise QinferError(
            f"unknown kv_cache_dtype {name!r}; use one of {', '.join(KV_CACHE_DTYPES)}"
        )


#: What LoRA adapters may be held in (an engine's lora_dtype, `--lora-dtype` as vLLM's);
#: `qinfer.lora.adapters.adapter_dtype` says what each means.
LORA_DTYPES = ("auto", "float32", "bfloat16")


def check_lora_dtype(name: str) -> None:
    """Refuse a name that is not one of LORA_DTYPES, in one line."""
    if name not in LORA_DTYPES:
        raise QinferError(f"unknown lora_dtype {name!r}; use one of {', '.join(LORA_DTYPES)}")


#: The names an engine's attention_backend (and `--attention-backend`) accepts;
#: `qinfer.attention.backend.choose_backend` says what each is.
ATTENTION_BACKENDS = ("auto", "paged", "gathered")


def check_attention_backend(name: str) -> None:
    """Refuse a name that is not one of ATTENTION_BACKENDS, in one line."""
    if name not in ATTENTION_BACKENDS:
        raise QinferError(
            f"unknown attention_backend {name!r}; use one of {', '.join(ATTENTION_BACKENDS)}"
        )


@dataclass(frozen=True)
class Features:
    """Switches passed to every layer (the seed's `features` argument).

    fast_sdpa: compute attention with `torch.nn.functional.scaled_dot_product_attention`
        (fused kernels on CPU and CUDA) instead of the explicit reference in
        `layers/attention.py`. Both give the same result; the tests hold them to it.
    kv_cache_dtype: how every cache of the model stores K/V between steps, the reference
        caches (`Transformer.make_cache`) and the engine's pool alike: "auto" (the compute
        dtype, as computed; bf16 where a GGUF file computes in fp32 on qinfer's exact
        kernels, `loading.load_model`), "bf16", "int8" or "fp8" (quantized per block of 32 elements of
        each token's head vector; see `qinfer.attention.kv_quant`). The one switch that changes
        results: by the bounded error the tests hold quantized caches to.
    batch_invariant: a token's logits do not depend on what else its engine step holds:
        the same alone or beside other sequences, at decode or in a prompt chunk of any
        length (chunked prefill, a prefix-cache hit, recomputation after preemption,
        speculative verification). Every paged query takes the decode arithmetic with fp64
        scores (`qinfer.attention.paged._decode`; quantized K/V caches' values summed in
        fp64 too), every quantized Linear its kernel at any row count and every dense one
        fixed-size GEMM chunks (`qinfer.linear.dense`). Without it a request of a quantized
        model is the same alone and in any batch as long as its prompt runs in the same
        chunks (the tests: each prompt in one pass), and prefill is faster (sdpa, tile
        GEMMs, whole GEMMs).
    exact: quantized Linears on CPU multiply the activations as they are (fp32 or bf16), the
        reference mode (`--exact`). By default they round them to int8 per block of 32 and
        multiply on integer dot products where the compiled kernels run, as llama.cpp does
        (`qinfer.linear.choose`): faster, with less drift from the fp32 dequantized model
        than llama.cpp's (tested); the residual stream, norms, softmax and logits stay fp32.
    """

    fast_sdpa: bool = True
    kv_cache_dtype: str = "auto"
    batch_invariant: bool = False
    exact: bool = False

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
