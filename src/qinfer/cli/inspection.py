"""`qinfer inspect`: one prompt's tokens, next-token candidates and one head's attention as
a PNG heatmap (what the inspector page shows)."""

from __future__ import annotations

import argparse
import sys

from qinfer.cli.shared import load_model_and_tokenizer
from qinfer.core.errors import QinferError
from qinfer.engine.args import add_model_arguments


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("prompt", help="the text to inspect (as-is; --chat: as a user message)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--layer", type=int, default=0, help="the layer (default: 0)")
    parser.add_argument("--head", type=int, default=0, help="the query head (default: 0)")
    parser.add_argument("--top-k", type=int, default=5, help="next-token candidates printed")
    parser.add_argument("--out", default=None, help="write the heatmap to this PNG file")


def run_inspect(args: argparse.Namespace) -> int:
    """Print the tokens and the next-token candidates; draw the head's attention to --out
    (the inspector page's heatmap)."""
    from qinfer.analysis.inspection import inspect_tokens
    from qinfer.text.prompts import encode_prompt

    if args.tensor_parallel_size != 1:
        raise QinferError(
            "inspect runs the whole model in one process: drop --tensor-parallel-size"
        )
    if args.out is not None:  # checked before the model loads, not after
        from qinfer.analysis.heatmap import check_png_writable

        check_png_writable(args.out)
    path, model, tokenizer = load_model_and_tokenizer(args)
    ids = encode_prompt(tokenizer, args.prompt, chat=args.chat, vocab_size=model.config.vocab_size)
    seen = inspect_tokens(model, ids, [args.layer], [args.head], args.top_k)
    texts = [tokenizer.decode([token_id]) for token_id in ids]
    print(" | ".join(texts))
    print(f"next token after {texts[-1]!r}:")
    for token_id, prob in zip(
        seen.next_tokens.ids[-1].tolist(), seen.next_tokens.probs[-1].tolist(), strict=True
    ):
        print(f"  {prob:7.2%}  {tokenizer.decode([token_id])!r}")
    if args.out is not None:
        from qinfer.analysis.heatmap import write_attention_png
        from qinfer.model.announcer import display_name

        title = f"{display_name(args.model, path)}: layer {args.layer}, head {args.head}"
        write_attention_png(seen.attention[args.layer][0], texts, args.out, title)
        print(f"wrote {args.out} ({title})", file=sys.stderr)
    return 0
