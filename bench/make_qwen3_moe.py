"""Save a random-weight Qwen3-MoE checkpoint, and a dense Qwen3 twin with as many active
parameters per token, to compare the cost of routing and grouping.

    python bench/make_qwen3_moe.py /tmp/qwen3-moe --dense-twin /tmp/qwen3-moe-dense-twin
    qinfer bench --model /tmp/qwen3-moe
    qinfer bench --model /tmp/qwen3-moe-dense-twin

The MoE has Qwen3-0.6B's attention and vocabulary, 8 layers of 32 experts of width 384, 4
picked per token (0.51 B parameters, 1.0 GB in bfloat16; Qwen3-30B-A3B has 48 layers of
128 experts of width 768, 8 picked, which does not fit a small machine). The twin's dense
MLP is 4 x 384 = 1536 wide: the same weights are read per token at batch 1. No tokenizer
is saved: `qinfer bench` works on token ids.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from make_qwen3_0p6b import QWEN3_0P6B, save  # bench/ is the script's folder

# Qwen3-0.6B's attention and vocabulary over 8 layers; the MLP width is set below.
SHARED = {k: v for k, v in QWEN3_0P6B.items() if k != "intermediate_size"}
SHARED["num_hidden_layers"] = 8
EXPERTS = dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=384)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to save the Qwen3-MoE checkpoint")
    parser.add_argument("--dense-twin", type=Path, help="where to save the dense Qwen3 twin")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    active_width = EXPERTS["num_experts_per_tok"] * EXPERTS["moe_intermediate_size"]
    save(
        args.folder,
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        **SHARED,
        intermediate_size=active_width,
        norm_topk_prob=True,
        **EXPERTS,
    )
    if args.dense_twin is not None:
        save(
            args.dense_twin,
            transformers.Qwen3Config,
            transformers.Qwen3ForCausalLM,
            **SHARED,
            intermediate_size=active_width,
        )


if __name__ == "__main__":
    main()
