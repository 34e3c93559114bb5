"""Write a random-weight GGUF shaped exactly like Qwen3-0.6B in Q4_0, llama.cpp's layout,
the real-size model of the CPU speed work (both engines load it).

    python bench/make_qwen3_0p6b_gguf.py /tmp/qwen3-0.6b-q4_0.gguf
    python bench/llama_cpp_peer.py --model /tmp/qwen3-0.6b-q4_0.gguf

Shapes are bench/make_qwen3_0p6b.py's (28 layers, hidden 1024, 16 query / 8 KV heads of 128,
FFN 3072, vocab 151936, tied embeddings), so every matmul and every byte read per token is
the real model's. Types as `llama-quantize ... Q4_0` leaves a tied model, except the
embedding: every layer projection Q4_0 (blocks of 32, one fp16 scale: 4.5 bits a weight), the
norms F32, and the embedding, which is also the head, Q8_0 (llama.cpp would write Q6_K there,
which `gguf.quants` cannot write; Q8_0 reads 8.5 bits a weight for 6.56, so the head costs
both engines ~30% more than in a real file). The weights are Gaussian (std 0.02, the norms
near 1): speed depends on shapes and types only.

The tokenizer is byte-level BPE of 151,936 entries, as Qwen's: the 256 byte tokens, merges
building the rest, Qwen's special tokens at their ids (<|endoftext|> 151643, <|im_start|>,
<|im_end|>, ...) and padding tokens to the vocabulary's size; llama.cpp checks its entries
against the embedding rows. Its text is nonsense; the benchmarks run on token ids.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_qwen3_0p6b import QWEN3_0P6B  # noqa: E402

Q = gguf.GGMLQuantizationType
#: Qwen3's added tokens from <|endoftext|> on (tokenizer_config.json's added_tokens_decoder).
SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]  # fmt: skip


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode map: byte b's token, in byte order (byte-level BPE's base)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted, n = {}, 0
    for b in range(256):
        if b not in printable:
            shifted[b] = 256 + n
            n += 1
    return [chr(b) if b in printable else chr(shifted[b]) for b in range(256)]


def vocabulary(size: int, first_special: int, seed: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): bytes, then `first_special - 256` merged tokens, each
    the concatenation of two earlier ones (its merge), then SPECIAL, then padding."""
    rng = np.random.default_rng(seed)
    tokens = byte_tokens()
    seen, merges = set(tokens), []
    while len(tokens) < first_special:
        # pairs weighted toward short tokens, as BPE's early merges are
        left, right = (tokens[int(i)] for i in rng.integers(0, len(tokens), 2) // 2)
        if len(left) + len(right) > 16 or left + right in seen:
            continue
        tokens.append(left + right)
        seen.add(left + right)
        merges.append(f"{left} {right}")
    types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens += SPECIAL
    types += [gguf.TokenType.CONTROL] * len(SPECIAL)
    padding = size - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(padding)]
    types += [gguf.TokenType.UNUSED] * padding
    return tokens, types, merges


def tensors(config: dict, rng: np.random.Generator):
    """(name, array or Q4_0/Q8_0 bytes, type) of every tensor, in llama.cpp's names."""
    H, F, D = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * D, config["num_key_value_heads"] * D

    def weight(rows: int, columns: int, qtype: Q):
        values = rng.standard_normal((rows, columns), dtype=np.float32) * 0.02
        return gguf.quants.quantize(values, qtype), qtype

    def norm(dims: int):
        return 1 + 0.1 * rng.standard_normal(dims, dtype=np.float32), Q.F32

    yield "token_embd.weight", *weight(config["vocab_size"], H, Q.Q8_0)
    yield "output_norm.weight", *norm(H)
    shapes = {
        "attn_q": (q_out, H), "attn_k": (kv_out, H), "attn_v": (kv_out, H),
        "attn_output": (H, q_out), "ffn_gate": (F, H), "ffn_up": (F, H), "ffn_down": (H, F),
    }  # fmt: skip
    for layer in range(config["num_hidden_layers"]):
        for name, dims in (
            ("attn_norm", H),
            ("ffn_norm", H),
            ("attn_q_norm", D),
            ("attn_k_norm", D),
        ):
            yield f"blk.{layer}.{name}.weight", *norm(dims)
        for name, (rows, columns) in shapes.items():
            yield f"blk.{layer}.{name}.weight", *weight(rows, columns, Q.Q4_0)


def write(path: Path, seed: int = 0) -> None:
    config = QWEN3_0P6B
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_name("Qwen3-0.6B-shaped random Q4_0")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    tokens, types, merges = vocabulary(config["vocab_size"], config["bos_token_id"], seed)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)
    rng = np.random.default_rng(seed)
    for name, array, qtype in tensors(config, rng):
        writer.add_tensor(name, array, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="the .gguf file to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    write(args.path, args.seed)
    size = args.path.stat().st_size
    print(f"wrote {args.path} ({size / 1e6:.0f} MB) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
