"""`qinfer generate`: stream a completion of one prompt to stdout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qinfer.cli.shared import (
    add_image_argument,
    load_streamer,
    print_stats,
    sampling_params,
    stream_to,
    user_message,
)
from qinfer.core.errors import QinferError
from qinfer.engine.args import (
    add_lora_argument,
    add_model_arguments,
    add_prompt_cache_arguments,
    add_sampling_arguments,
    add_speculative_arguments,
)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_speculative_arguments(parser)
    add_prompt_cache_arguments(parser)
    add_lora_argument(parser)
    add_sampling_arguments(parser, chat=False)
    add_image_argument(parser)
    parser.add_argument(
        "--no-chat",
        action="store_true",
        help="use the prompt as-is instead of through the model's chat template",
    )
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema",
        metavar="FILE",
        default=None,
        help="the output is JSON valid under the JSON schema in FILE",
    )
    constraint.add_argument(
        "--regex", default=None, help="the whole output matches this regular expression"
    )
    parser.add_argument("prompt", help="the text to continue (or the user message)")


def read_json_schema(file: str | None) -> str | None:
    """The text of the --json-schema file (checked when the request is made), or None."""
    if file is None:
        return None
    try:
        return Path(file).read_text(encoding="utf-8")
    except OSError as error:
        raise QinferError(f"cannot read the JSON schema {file}: {error.strerror}") from None


def run_generate(args: argparse.Namespace) -> int:
    if not args.prompt:
        raise QinferError("prompt is empty: give some text to continue")
    schema = read_json_schema(args.json_schema)
    path, tokenizer, stream_generate = load_streamer(args)
    params = sampling_params(args, path).replace(json_schema=schema, regex=args.regex)
    chat = tokenizer.has_chat_template and not args.no_chat
    if chat:
        prompt = [user_message(args.prompt, args.image)]
        if args.system:
            prompt.insert(0, {"role": "system", "content": args.system})
    elif args.system or args.image:
        flag = "--system" if args.system else "--image"
        raise QinferError(f"{flag} needs the chat template (drop --no-chat)")
    else:
        prompt = args.prompt
    stream = stream_generate(prompt, params)
    stream_to(sys.stdout, stream)
    print_stats(stream.result)
    return 0
