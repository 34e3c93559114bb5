"""The `qinfer` command line: one subcommand per job.

    qinfer generate [--model M] PROMPT      stream a completion of PROMPT to stdout
    qinfer chat [--model M]                 a multi-turn chat read from stdin
    (either with --image PATH: the first user message shows it to a vision-language model)
    qinfer bench [--model M] [--json]       prefill / decode speed, memory, weight GB/s
    qinfer serve [--model M] [--port P]     the OpenAI-compatible HTTP API (and web pages)
    qinfer inspect PROMPT --layer L --head H --out attn.png
                                            one head's attention as a PNG heatmap

Each subcommand is a `Command`: a function that adds its arguments and a function that
runs it, in a module of its own here (`generate`, `chat`, `bench`, `inspection`,
`perplexity`; `serve`'s in `qinfer.server.command`); `COMMANDS` lists them. Adding one is
writing those two functions and appending a `Command` to the list.

Any `QinferError` (bad model path, empty prompt, invalid sampling field) and any misuse
of the command line print one line, `qinfer: error: ...`, on stderr and exit with
status 2: never a traceback. Flags are checked as they are parsed (`qinfer.engine.args`), before
torch is imported or a model loaded; so are --device and serve's --host/--port.

Once a model is loaded, one line on stderr says what runs (`qinfer.model.announcer`). Ctrl-C
during `chat`'s reply returns to the prompt; elsewhere it ends the command (status 130).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from qinfer.cli.bench import add_bench_arguments, run_bench
from qinfer.cli.chat import add_chat_arguments, run_chat
from qinfer.cli.generate import add_generate_arguments, run_generate
from qinfer.cli.inspection import add_inspect_arguments, run_inspect
from qinfer.cli.perplexity import add_perplexity_arguments, run_perplexity
from qinfer.core.errors import QinferError
from qinfer.request.chat_defaults import CHAT_DEFAULTS, GENERATE_MAX_TOKENS
from qinfer.server.command import add_serve_arguments, run_serve

USAGE_ERROR = 2


@dataclass(frozen=True)
class Command:
    """A subcommand: its name, one line of help, its arguments, what it runs and, for its
    own --help, a longer description."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None  # `qinfer NAME --help`'s text (default: help)


class _Parser(argparse.ArgumentParser):
    """argparse, with usage mistakes reported like every other error: one line, exit 2."""

    def error(self, message: str) -> NoReturn:
        raise QinferError(f"{message} (see: {self.prog} --help)")


COMMANDS = [
    Command(
        "generate",
        "stream a completion of one prompt",
        add_generate_arguments,
        run_generate,
        "Stream a completion of one prompt. Decodes greedily, as transformers does, unless "
        "the checkpoint's generation_config.json samples; at most "
        f"{GENERATE_MAX_TOKENS} new tokens.",
    ),
    Command(
        "chat",
        "chat with a model, one line per turn",
        add_chat_arguments,
        run_chat,
        "Chat with a model, one line per turn. Samples as a chat should: the checkpoint's "
        "generation_config.json settings, else temperature "
        f"{CHAT_DEFAULTS['temperature']}, top-p {CHAT_DEFAULTS['top_p']} and repetition "
        f"penalty {CHAT_DEFAULTS['repetition_penalty']}; at most "
        f"{CHAT_DEFAULTS['max_tokens']} new tokens a reply (the same defaults as the "
        "server's /v1/chat/completions); --temperature 0 is plain greedy decoding. Ctrl-C "
        "stops a reply (kept in the history as shown); twice in a row leaves.",
    ),
    Command("bench", "measure prefill and decode speed", add_bench_arguments, run_bench),
    Command(
        "serve",
        "serve the OpenAI HTTP API and the chat page",
        add_serve_arguments,
        run_serve,
        "Serve the OpenAI HTTP API, the chat page (/) and the attention inspector (/inspect). "
        "/v1/chat/completions fills the sampling fields a request leaves unset as `qinfer "
        "chat` does (temperature "
        f"{CHAT_DEFAULTS['temperature']}, top-p {CHAT_DEFAULTS['top_p']}, repetition penalty "
        f"{CHAT_DEFAULTS['repetition_penalty']}, max_tokens {CHAT_DEFAULTS['max_tokens']}, "
        "unless the checkpoint's generation_config.json says otherwise); /v1/completions "
        "decodes greedily. Ctrl-C aborts running requests and stops.",
    ),
    Command(
        "inspect", "show a prompt's attention and predictions", add_inspect_arguments, run_inspect
    ),
    Command(
        "perplexity",
        "score a text: perplexity, KL divergence from a reference",
        add_perplexity_arguments,
        run_perplexity,
        "Perplexity of the model on a text file, chunked and scored as llama.cpp's "
        "llama-perplexity does (each chunk's second half); with --kl-divergence-base, the "
        "mean KL divergence of the model's next-token distribution from the reference's "
        "(run in float32) and how often their top tokens agree.",
    ),
]


def build_parser() -> argparse.ArgumentParser:
    import qinfer

    parser = _Parser(prog="qinfer", description="A small, readable inference engine.")
    parser.add_argument("--version", action="version", version=f"qinfer {qinfer.__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = subcommands.add_parser(
            command.name, help=command.help, description=command.description or command.help
        )
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `qinfer` console script; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except QinferError as error:
        print(f"qinfer: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `qinfer generate ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 0
