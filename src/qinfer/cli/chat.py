"""`qinfer chat`: a multi-turn chat read line by line from stdin."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from qinfer.engine.generation import TextStream


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_speculative_arguments(parser)
    add_prompt_cache_arguments(parser)
    add_lora_argument(parser)
    add_sampling_arguments(parser, chat=True)
    add_image_argument(parser)


#: What a Ctrl-C at the prompt, or during a reply, prints (on stderr).
LEAVE_HINT = "(Ctrl-C again, Ctrl-D or /exit to leave)"


def run_chat(args: argparse.Namespace) -> int:
    """Read user turns line by line from stdin (a terminal or a pipe) until /exit or EOF.

    Ctrl-C during a reply stops it and returns to the prompt; the history keeps the turn
    with the part of the reply that was shown (the model remembers what you saw). Two
    Ctrl-C in a row (during a reply and then at the prompt, or twice at the prompt)
    leave, with status 130. A turn the model cannot take (the conversation outgrew the
    context) is reported on stderr and left out of the history; the chat goes on."""
    # Ctrl-C is how a reply is stopped, so chat takes SIGINT even where it came in ignored
    # (a shell starts background jobs so, and Python then leaves it ignored), as `serve`
    # takes it through uvicorn.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    path, tokenizer, stream_generate = load_streamer(args)
    if not tokenizer.has_chat_template:
        raise QinferError(f"{path} has no chat template: use `qinfer generate --no-chat`")
    params = sampling_params(args, path, chat=True)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    images = list(args.image)  # shown by the first user turn (again after /reset)
    interactive = sys.stdin.isatty()
    if interactive:
        print("(type /reset to forget the conversation, /exit to leave)", file=sys.stderr)
    interrupted = False  # the last thing that happened was a Ctrl-C
    while True:
        shown: list[str] | None = None  # while a reply streams: its deltas so far
        try:
            if interactive:
                print(">>> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            interrupted = False
            if not line:  # end of input
                return 0
            line = line.strip()
            if line == "/exit":
                return 0
            if line == "/reset":
                messages, images = list(start), list(args.image)
                print("(conversation reset)", file=sys.stderr)
                continue
            if not line:
                continue
            turn = [*messages, user_message(line, images)]
            try:
                stream = stream_generate(turn, params)
            except QinferError as error:  # e.g. the conversation outgrew the context
                if images:  # an image the model cannot take ends the chat, as a bad flag
                    raise
                print(f"qinfer: error: {error} (/reset starts over)", file=sys.stderr)
                continue
            images = []  # in the history now: later turns show them again, cached
            shown = []
            stream_to(sys.stdout, stream, shown)
            result = stream.result
            # Chat templates drop past reasoning themselves; keep only the answer in history.
            reply = result.answer if result.answer is not None else result.text
            messages, shown = [*turn, {"role": "assistant", "content": reply}], None
            print_stats(result)
        except KeyboardInterrupt:
            if interrupted:
                print(file=sys.stderr)
                return 130
            interrupted = True
            if shown is None:  # at the prompt
                print(f"\n{LEAVE_HINT}", file=sys.stderr)
                continue
            reply = shown_answer(stream, "".join(shown))
            messages = [*turn, {"role": "assistant", "content": reply}]
            print(f"[reply stopped; kept in the history as shown] {LEAVE_HINT}", file=sys.stderr)


def shown_answer(stream: TextStream, shown: str) -> str:
    """The answer part of a reply stopped midway (its reasoning dropped, as a finished
    reply's is) for a thinking model; the shown text for the others."""
    from qinfer.text.reasoning import split_reasoning

    opened = stream.prompt_opened_think  # decided once, when the request was made
    return shown if opened is None else split_reasoning(shown, opened)[1]
