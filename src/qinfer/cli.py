"""The `qinfer` command line: one subcommand per job.

    qinfer generate [--model M] PROMPT      stream a completion of PROMPT to stdout
    qinfer chat [--model M]                 a multi-turn chat read from stdin
    (either with --image PATH: the first user message shows it to a vision-language model)
    qinfer bench [--model M] [--json]       prefill / decode speed, memory, weight GB/s
    qinfer serve [--model M] [--port P]     the OpenAI-compatible HTTP API (and web pages)
    qinfer inspect PROMPT --layer L --head H --out attn.png
                                            one head's attention as a PNG heatmap

Each subcommand is a `Command`: a function that adds its arguments and a function that
runs it; `COMMANDS` lists them. Adding one (say `serve`) is writing those two functions
and appending a `Command` to the list.

Any `QinferError` (bad model path, empty prompt, invalid sampling field) and any misuse
of the command line print one line, `qinfer: error: ...`, on stderr and exit with
status 2: never a traceback. Flags are checked as they are parsed (`cli_args`), before
torch is imported or a model loaded; so are --device and serve's --host/--port.

Once a model is loaded, one line on stderr says what runs (`qinfer.startup`). Ctrl-C
during `chat`'s reply returns to the prompt; elsewhere it ends the command (status 130).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TextIO

from qinfer.chat_defaults import CHAT_DEFAULTS, GENERATE_MAX_TOKENS, chat_sampling_params
from qinfer.cli_args import (
    add_mmproj_argument,
    add_model_arguments,
    add_sampling_arguments,
    add_speculative_arguments,
    bounded,
    check_device,
    load_arguments,
    speculative_arguments,
)
from qinfer.errors import QinferError
from qinfer.server.command import add_serve_arguments, run_serve

if TYPE_CHECKING:  # the heavy imports wait until a subcommand needs them
    from qinfer.engine.llm import EngineTextStream
    from qinfer.generation import GenerationResult, Prompt, TextStream
    from qinfer.model import Transformer
    from qinfer.sampling import SamplingParams
    from qinfer.startup import LoadAnnouncer
    from qinfer.text.tokenizer import Tokenizer

    #: One prompt in, its text deltas out (`.result` once read).
    Streamer = Callable[[Prompt, SamplingParams], TextStream | EngineTextStream]

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


# --- helpers shared by several subcommands ---------------------------------------------


def load_model_and_tokenizer(
    args: argparse.Namespace,
) -> tuple[Path, Transformer, Tokenizer]:
    """(path, model, tokenizer) for --model / --dtype / --device / --quantize / --group-size,
    announced as `qinfer.startup` says."""
    path, announcer = start_loading(args)
    from qinfer.loading import load_model
    from qinfer.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)  # before the model: a missing tokenizer fails fast
    model = load_model(path, **load_arguments(args))
    announcer.finished(model)
    return path, model, tokenizer


def start_loading(args: argparse.Namespace) -> tuple[Path, LoadAnnouncer]:
    """The checkpoint's path once --model and --device are known good; the load announced."""
    from qinfer.checkpoint import resolve_model
    from qinfer.startup import LoadAnnouncer, display_name

    path = resolve_model(args.model)
    announcer = LoadAnnouncer(display_name(args.model, path), path)
    announcer.started()  # before torch's import: the first second is not silent
    check_device(args)
    return path, announcer


def load_streamer(args: argparse.Namespace) -> tuple[Path, Tokenizer, Streamer]:
    """(path, tokenizer, stream) for the model flags: at --tensor-parallel-size 1 the plain
    generator over a loaded model (`stream_generate`); above, with speculative decoding
    (whose draft model loads once) or with --image (a vision-language checkpoint's tower
    loads with it), a batching engine whose rank 0 this process is (`LLM.stream`), its
    workers following each step."""
    speculative = speculative_arguments(args)
    # images need the engine's vision tower, which a checkpoint's engine loads
    images = args.image or args.mmproj
    if args.tensor_parallel_size == 1 and speculative is None and not images:
        path, model, tokenizer = load_model_and_tokenizer(args)  # announced before torch's import
        from functools import partial

        from qinfer.generation import stream_generate

        return path, tokenizer, partial(stream_generate, model, tokenizer)
    path, announcer = start_loading(args)
    from qinfer.engine.llm import LLM
    from qinfer.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)  # before the model: a missing tokenizer fails fast
    llm = LLM(
        path,
        tokenizer,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative=speculative,
        mmproj=args.mmproj,
        **load_arguments(args),
    )
    announcer.finished(llm.engine.executor.model)
    return path, tokenizer, llm.stream


def sampling_params(args: argparse.Namespace, path: Path, *, chat: bool = False) -> SamplingParams:
    """The sampling flags given, over the checkpoint's generation_config.json, over the
    command's defaults: `chat` samples (`chat_defaults.chat_sampling_params`, as the
    server's chat endpoint does); `generate` keeps `SamplingParams.from_generation_config`'s
    rule (greedy without a generation config, as transformers and the engine)."""
    flags = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    if chat:
        return chat_sampling_params(path, **flags)
    from qinfer.sampling import SamplingParams

    flags["max_tokens"] = args.max_tokens or GENERATE_MAX_TOKENS
    return SamplingParams.from_generation_config(path, **flags)


def stream_to(out: TextIO, stream: TextStream, shown: list[str] | None = None) -> None:
    """Write a TextStream's deltas as they come, then a newline; each delta is added to
    `shown` as it is written (what was on screen when a Ctrl-C stopped the stream)."""
    try:
        for delta in stream:
            if shown is not None:
                shown.append(delta)
            out.write(delta)
            out.flush()
    finally:
        out.write("\n")
        out.flush()


def print_stats(result: GenerationResult) -> None:
    """Token counts and speeds of one GenerationResult, on stderr (stdout holds the text)."""
    t = result.timings
    print(
        f"[{result.prompt_tokens} prompt tokens, {result.generated_tokens} generated; "
        f"prefill {t.prefill_tokens_per_second:.1f} tok/s, "
        f"decode {t.decode_tokens_per_second:.1f} tok/s; finish: {result.finish_reason}]",
        file=sys.stderr,
    )


# --- qinfer generate ----------------------------------------------------------------------


def add_image_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image the (first) user message shows, before its text, for a "
        "vision-language checkpoint (Qwen2.5-VL, Qwen3-VL); repeat for several",
    )
    add_mmproj_argument(parser)


def user_message(text: str, images: list[str]) -> dict:
    """A user message of `text`, after the content parts of `images` (paths) if any."""
    if not images:
        return {"role": "user", "content": text}
    parts = [{"type": "image", "image": path} for path in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_speculative_arguments(parser)
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


# --- qinfer chat --------------------------------------------------------------------------


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_speculative_arguments(parser)
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


# --- qinfer bench -------------------------------------------------------------------------


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_speculative_arguments(parser)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prefill length")
    parser.add_argument(
        "--decode-tokens",
        type=bounded(int, 1),
        default=None,
        help="tokens decoded per row (default: 32; with speculative decoding, at most 192 "
        "per request)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="rows of the batched decode")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; the best counts")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--compare-hf", action="store_true", help="also run transformers")
    parser.add_argument(
        "--batch",
        action="store_true",
        help="64 mixed requests: batching engine vs one by one (see bench/bench_engine.py)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from qinfer.bench import (
        BenchSettings,
        format_engine_report,
        format_report,
        run_benchmarks,
        run_engine_benchmark,
    )

    if args.threads is not None:
        if args.threads < 1:
            raise QinferError(f"--threads must be at least 1, got {args.threads}")
        # On a shared machine, fewer threads than cores avoids OpenMP threads spinning
        # while their partners wait to be scheduled.
        torch.set_num_threads(args.threads)
    speculative = speculative_arguments(args)
    if speculative is not None:
        from qinfer.bench.speculative import format_speculative_report, run_speculative_benchmark

        report = run_speculative_benchmark(
            args.model,
            load_arguments(args),
            speculative,
            repeats=args.repeats,
            max_tokens=args.decode_tokens or 192,
        )
        print(json.dumps(report, indent=2) if args.json else format_speculative_report(report))
        return 0
    if args.batch:
        report = run_engine_benchmark(
            args.model,
            load_arguments(args),
            compare_hf=args.compare_hf,
            tensor_parallel_size=args.tensor_parallel_size,
        )
        print(json.dumps(report, indent=2) if args.json else format_engine_report(report))
        return 0
    if args.tensor_parallel_size != 1:
        raise QinferError("bench runs the model in one process: use --batch (the engine) at TP > 1")
    settings = BenchSettings(
        prompt_tokens=args.prompt_tokens,
        decode_tokens=args.decode_tokens or 32,
        batch_size=args.batch_size,
        repeats=args.repeats,
    )
    report = run_benchmarks(args.model, load_arguments(args), settings, args.compare_hf)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


# --- qinfer inspect ----------------------------------------------------------------------


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
    from qinfer.inspection import inspect_tokens
    from qinfer.text.prompts import encode_prompt

    if args.tensor_parallel_size != 1:
        raise QinferError(
            "inspect runs the whole model in one process: drop --tensor-parallel-size"
        )
    if args.out is not None:  # checked before the model loads, not after
        from qinfer.heatmap import check_png_writable

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
        from qinfer.heatmap import write_attention_png
        from qinfer.startup import display_name

        title = f"{display_name(args.model, path)}: layer {args.layer}, head {args.head}"
        write_attention_png(seen.attention[args.layer][0], texts, args.out, title)
        print(f"wrote {args.out} ({title})", file=sys.stderr)
    return 0


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
        from qinfer.checkpoint import resolve_model
        from qinfer.loading import load_model

        base = load_model(
            resolve_model(args.kl_divergence_base), dtype="float32", device=args.device
        )
    from tqdm.auto import tqdm

    from qinfer.perplexity import perplexity

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


if __name__ == "__main__":
    sys.exit(main())
