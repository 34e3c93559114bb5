"""`qinfer perplexity`: a text's perplexity, chunked and scored as llama.cpp's
llama-perplexity does, and its KL divergence from a float32 reference."""

from __future__ import annotations

import argparse
from pathlib import Path

from qinfer.cli.shared import load_model_and_tokenizer
from qinfer.core.errors import QinferError
from qinfer.engine.args import add_model_arguments, bounded


def add_perplexity_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("text_file", help="the text to score (UTF-8)")
    parser.add_argument(
        "--context",
        type=bounded(int, 4),
        default=512,
        help="tokens per chunk; each chunk's second half is scored (default: 512)",
    )
    parser.add_argument(
        "--kl-divergence-base",
        default=None,
        metavar="REF",
        help="a checkpoint run in float32 as the reference (the same GGUF file: its exact "
        "dequantization): also print KL(REF || model) and top-1 agreement",
    )


def run_perplexity(args: argparse.Namespace) -> int:
    """Perplexity of the model on a text, and its divergence from a float32 reference."""
    text_file = Path(args.text_file)
    if not text_file.is_file():  # before the model loads
        raise QinferError(f"text_file {text_file} is not a file")
    text = text_file.read_text(encoding="utf-8")
    path, model, tokenizer = load_model_and_tokenizer(args)
    base = None
    if args.kl_divergence_base is not None:
        from qinfer.core.checkpoint import resolve_model
        from qinfer.model.loading import load_model

        base = load_model(
            resolve_model(args.kl_divergence_base), dtype="float32", device=args.device
        )
    from tqdm.auto import tqdm

    from qinfer.analysis.perplexity import perplexity

    ids = tokenizer.encode(text)
    with tqdm(desc="chunks", disable=None, leave=False) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        result = perplexity(model, ids, args.context, base, progress)
    print(f"{len(ids)} tokens, {result.chunks} chunks of {args.context}, {result.scored} scored")
    print(f"perplexity {result.perplexity:.4f} (mean NLL {result.nll:.5f})")
    if result.kl is not None:
        print(
            f"KL divergence from {args.kl_divergence_base}: mean {result.kl:.6f}, max {result.kl_max:.4f}"
        )
        print(f"top-1 agreement {result.top1:.4%}")
    return 0
