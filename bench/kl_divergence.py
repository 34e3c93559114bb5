"""How far qinfer's default (quantized) path and llama.cpp drift from the fp32 reference
on the same GGUF file and the same real text, measured as llama-perplexity measures it;
with --kv-cache, also how much a quantized KV cache adds, in each engine.

    python bench/kl_divergence.py                          # the embedded SmolLM2 Q4_1
    python bench/kl_divergence.py --model ~/.cache/qinfer/gemma-3-270m-q4_k_m.gguf
    python bench/kl_divergence.py --kv-cache               # + int8 / fp8 / q8_0 KV caches
    python bench/kl_divergence.py --quantize --offset 300  # + --quantize int8 / int4, windows
                                                           #   from token 300 on

The reference is qinfer with the file dequantized to fp32 (`dtype="float32"`: every
block expanded exactly, the parity tests' path). Both qinfer's default load (kept Q4 bits
as int4 groups, other blocks as int8 rows, bf16 activations) and llama.cpp (its own
kernels on the same blocks) are scored against it: mean KL(reference || engine) per
token, its largest value, top-1 agreement, and each engine's perplexity. The text is
tests/real_text.txt (the project's own prose), from token --offset on (0: the document's
start; any other: windows that start mid-document), in chunks of --context tokens, each
scored on its second half. llama.cpp runs through llama-cpp-python (`pip install 'qinfer[peer]'`).
The tests hold qinfer's drift to a bound set from llama.cpp's figure printed here.

--quantize adds `--quantize int8` and `--quantize int4` beside llama.cpp's own requantization
of the same file to Q8_0 and to Q4_0 (llama-quantize --allow-requantize, through
llama-cpp-python's `llama_model_quantize`; it keeps the tied or output head at Q6_K for
Q4_0), each scored against the same fp32 reference of the original file.

--kv-cache adds qinfer's default path with an int8 and an fp8 KV cache, the fp32 reference
with an int8 KV cache (the cache's cost alone), and llama.cpp with its q8_0 K and V cache
(type_k = type_v = GGML_TYPE_Q8_0, which needs flash attention for V) beside llama.cpp with
flash attention and its f16 cache (the same kernels, so the difference is the cache's).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch

from qinfer import load_model, load_tokenizer
from qinfer.analysis.perplexity import score, scored_log_probs
from qinfer.core.checkpoint import resolve_model

TEXT = Path(__file__).resolve().parent.parent / "tests" / "real_text.txt"


#: ggml's type id of Q8_0 (blocks of 32 int8 values and one fp16 scale), llama.cpp's
#: 8-bit KV cache.
GGML_TYPE_Q8_0 = 8
#: `--quantize` kind -> the llama.cpp file type (llama_ftype) of its requantization.
LLAMA_FTYPES = {"int8": ("Q8_0", 7), "int4": ("Q4_0", 2)}


def llama_cpp_requantized(path: Path, kind: str, directory: Path, threads: int) -> Path:
    """`path` requantized by llama.cpp to the type `LLAMA_FTYPES[kind]` names, in directory."""
    import llama_cpp

    name, ftype = LLAMA_FTYPES[kind]
    out = directory / f"{path.stem}-{name}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, threads
    if llama_cpp.llama_model_quantize(str(path).encode(), str(out).encode(), ctypes.byref(params)):
        raise SystemExit(f"llama.cpp could not requantize {path} to {name}")
    return out


def llama_cpp_scorer(path: Path, context: int, threads: int, **params):
    """A `qinfer.analysis.perplexity.Scorer` running llama.cpp on the file (params: more of
    `llama_cpp.Llama`'s context parameters, such as its KV cache types)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=context,
        logits_all=True,
        n_threads=threads,
        verbose=False,
        **params,
    )

    def scorer(chunk: torch.Tensor) -> torch.Tensor:
        llm.reset()
        llm.eval(chunk.tolist())
        n = len(chunk)
        logits = torch.from_numpy(np.array(llm.scores[n // 2 : n - 1], dtype=np.float32))
        return torch.log_softmax(logits, dim=-1)

    return scorer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default SmolLM2 Q4_1)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--offset", type=int, default=0, help="tokens of the text skipped")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--kv-cache", action="store_true", help="also measure quantized KV caches (see above)"
    )
    parser.add_argument(
        "--quantize", action="store_true", help="also the file requantized: --quantize int8, int4"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    ids = load_tokenizer(path).encode(TEXT.read_text())
    ids = ids[args.offset : args.offset + args.chunks * args.context]
    reference = load_model(path, dtype="float32", device="cpu")
    default = load_model(path, device="cpu")
    base = lambda chunk: scored_log_probs(reference, chunk)  # noqa: E731
    models = {"qinfer default": default}
    if args.kv_cache:
        models["qinfer default, int8 KV"] = load_model(path, device="cpu", kv_cache_dtype="int8")
        models["qinfer default, fp8 KV"] = load_model(path, device="cpu", kv_cache_dtype="fp8")
        models["qinfer fp32, int8 KV"] = load_model(
            path, dtype="float32", device="cpu", kv_cache_dtype="int8"
        )
    if args.quantize:
        for kind in ("int8", "int4"):
            models[f"qinfer --quantize {kind}"] = load_model(path, device="cpu", quantize=kind)
    rows = {"qinfer fp32 (reference)": score(base, ids, args.context)}
    for name, model in models.items():
        rows[name] = score(partial(scored_log_probs, model), ids, args.context, base)
    peers = {"llama.cpp": {}}
    if args.kv_cache:
        peers["llama.cpp flash-attn, f16 KV"] = {"flash_attn": True}
        q8_0 = {"type_k": GGML_TYPE_Q8_0, "type_v": GGML_TYPE_Q8_0}
        peers["llama.cpp flash-attn, q8_0 KV"] = {"flash_attn": True, **q8_0}
    try:
        for name, params in peers.items():
            scorer = llama_cpp_scorer(path, args.context, args.threads, **params)
            rows[name] = score(scorer, ids, args.context, base)
        with tempfile.TemporaryDirectory() as directory:
            for kind in LLAMA_FTYPES if args.quantize else ():
                requantized = llama_cpp_requantized(path, kind, Path(directory), args.threads)
                scorer = llama_cpp_scorer(requantized, args.context, args.threads)
                rows[f"llama.cpp requantized {LLAMA_FTYPES[kind][0]}"] = score(
                    scorer, ids, args.context, base
                )
    except ImportError:
        print("llama.cpp: skipped (pip install 'qinfer[peer]')")
    if args.json:
        print(json.dumps({name: vars(r) for name, r in rows.items()}, indent=2))
        return
    print(f"{path.name}: {len(ids)} tokens of {TEXT.name}, context {args.context}")
    for name, r in rows.items():
        kl = "" if r.kl is None else f"  KL {r.kl:.5f} (max {r.kl_max:.3f})  top-1 {r.top1:.3%}"
        print(f"{name:>30}: perplexity {r.perplexity:.3f}{kl}")


if __name__ == "__main__":
    main()
