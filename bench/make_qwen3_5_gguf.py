"""Write a random-weight GGUF shaped like Qwen3.5-0.8B in Q4_0, as llama.cpp writes one: the
real-size hybrid model of the CPU speed work (both engines load it).

    python bench/make_qwen3_5_gguf.py /tmp/qwen3.5-0.8b-q4_0.gguf
    python bench/llama_cpp_peer.py --model /tmp/qwen3.5-0.8b-q4_0.gguf
    python bench/make_qwen3_5_gguf.py --mtp /tmp/qwen3.5-0.8b-mtp-q4_0.gguf  # with nextn tensors

Three steps, each the tool a user's file went through: transformers saves a random
`Qwen3_5ForCausalLM` of Qwen3.5-0.8B's shapes (bf16, weights N(0, 0.02), norms near their
fresh values); llama.cpp's own converter (`convert_hf_to_gguf.py`, where `make setup-test`
unpacks it) writes it as a BF16 `qwen35` file; llama.cpp's `llama_model_quantize` takes that
to Q4_0 (its Q4_0 mix: the projections Q4_0, the tied embedding and head Q6_K, the
DeltaNet's conv kernel, decays and norms F32). Speed depends on shapes and types only.

Shapes (Qwen3.5-0.8B's config.json, as issue 50 lists them): 24 layers, three Gated
DeltaNet layers then one gated full-attention layer; hidden 1024; attention 8 query / 2 KV
heads of 256, a quarter of each rotated (M-RoPE sections 11/11/10, theta 1e7); DeltaNet 16
key and 16 value heads of 128, conv kernel 4; FFN 3584; vocabulary 248,320, tied.

With `--mtp` the checkpoint also gets the MTP head every released Qwen3.5 carries (`mtp.*`,
`mtp_num_hidden_layers: 1`: a copy of its last full-attention layer, a random fc of
N(0, 0.02) and fresh norms), which the converter writes as nextn tensors (`--speculative-method
mtp`); its proposals are random guesses, so the file measures the head's cost, not its
acceptance.

The tokenizer is a byte-level BPE of 256 byte tokens, one merge and ChatML's special tokens; the
converter pads the vocabulary to 248,320 entries, as it does for a released checkpoint
whose tokenizer holds fewer ids than its embedding has rows. The benchmarks run on ids.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Qwen3.5-0.8B's text config (the fields transformers' defaults do not already give).
QWEN3_5_0P8B = dict(
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
    tie_word_embeddings=True,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        mrope_section=[11, 11, 10],
        mrope_interleaved=True,
    ),
    bos_token_id=None,
    eos_token_id=259,  # <|im_end|> of the tokenizer below
)
#: Where `make setup-test` unpacks llama.cpp's converter (tests/test_vl_gguf.py's CONVERTER).
CONVERTER = Path(sys.prefix) / "llama-cpp-converter"
#: The converter, with the vocabulary's pre-tokenizer named "qwen2" (it recognises one by
#: hashing a released tokenizer's tokens, and this one matches none), as the tests run it.
RUN_CONVERTER = """
import runpy, sys
root, *args = sys.argv[1:]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = [root + "/convert_hf_to_gguf.py", *args]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
#: llama.cpp's file type (llama_ftype) MOSTLY_Q4_0.
LLAMA_FTYPE_Q4_0 = 2


def save_checkpoint(folder: Path, seed: int) -> None:
    """A random Qwen3.5-0.8B-shaped checkpoint and a byte-level tokenizer in `folder`."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**QWEN3_5_0P8B))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.to(torch.bfloat16).save_pretrained(folder)
    del model
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 stand-ins for the bytes
    vocab = {c: i for i, c in enumerate(alphabet)} | {"\u0120t": len(alphabet)}
    # one merge (" t"): llama.cpp refuses a BPE vocabulary without any
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("\u0120", "t")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(special))


def add_mtp_head(folder: Path, seed: int) -> None:
    """Give the saved checkpoint in `folder` an MTP head (see the module docstring), as one
    more safetensors part listed in its index (when it has one)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((folder / "config.json").read_text())
    last = max(i for i, kind in enumerate(QWEN3_5_0P8B["layer_types"]) if kind == "full_attention")
    index = folder / "model.safetensors.index.json"
    parts = sorted(folder.glob("model*.safetensors"))
    head: dict[str, torch.Tensor] = {}
    for part in parts:
        with safe_open(part, "pt") as stored:
            for name in stored.keys():
                if name.startswith(f"model.layers.{last}."):
                    head[f"mtp.layers.0.{name.split('.', 3)[3]}"] = stored.get_tensor(name).clone()
    hidden = QWEN3_5_0P8B["hidden_size"]
    generator = torch.Generator().manual_seed(seed)
    fc = torch.randn(hidden, 2 * hidden, generator=generator) * 0.02
    head["mtp.fc.weight"] = fc.to(torch.bfloat16)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        head[f"mtp.{norm}.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)  # 1 + w = 1
    save_file(head, folder / "model-mtp.safetensors", metadata={"format": "pt"})
    if index.exists():
        listed = json.loads(index.read_text())
        listed["weight_map"] |= dict.fromkeys(head, "model-mtp.safetensors")
        index.write_text(json.dumps(listed))
    (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))


def convert(folder: Path, out: Path, mtp: bool) -> None:
    """`folder` as a BF16 GGUF `out`, written by llama.cpp's converter (with the MTP head's
    nextn tensors, or without)."""
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"llama.cpp's converter is not in {CONVERTER}: run make setup-test")
    args = [str(folder), *([] if mtp else ["--no-mtp"]), "--outtype", "bf16"]
    args += ["--outfile", str(out)]
    done = subprocess.run(
        [sys.executable, "-c", RUN_CONVERTER, str(CONVERTER), *args],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"the converter failed: {done.stderr[-3000:]}")


def quantize(source: Path, out: Path, threads: int) -> None:
    """`source` to Q4_0 by llama.cpp's `llama_model_quantize`."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = LLAMA_FTYPE_Q4_0, threads
    if llama_cpp.llama_model_quantize(
        str(source).encode(), str(out).encode(), ctypes.byref(params)
    ):
        raise SystemExit(f"llama.cpp could not quantize {source} to Q4_0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="the .gguf file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mtp", action="store_true", help="keep an MTP head (nextn tensors)")
    args = parser.parse_args()
    start = time.perf_counter()
    # the BF16 file beside the target, kept until the quantization succeeds: a failed one
    # (llama-cpp-python missing) does not write and convert 1.6 GB again
    bf16 = args.path.with_suffix(".bf16.gguf")
    if not bf16.exists():
        with tempfile.TemporaryDirectory(dir=args.path.parent) as folder:
            save_checkpoint(Path(folder), args.seed)
            if args.mtp:
                add_mtp_head(Path(folder), args.seed)
            print(f"saved the checkpoint ({time.perf_counter() - start:.0f} s)", flush=True)
            convert(Path(folder), bf16, args.mtp)
        print(f"converted it ({time.perf_counter() - start:.0f} s)", flush=True)
    quantize(bf16, args.path, args.threads)
    bf16.unlink()
    size = args.path.stat().st_size
    print(f"wrote {args.path} ({size / 1e6:.0f} MB) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
