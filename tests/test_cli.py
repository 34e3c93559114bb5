"""The `qinfer` command line: generate and chat end to end in a subprocess (checked against
the Python API on the same checkpoint), bench's report, and bad input as one line + exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from checkpoints import build_chat_checkpoint, build_checkpoint

import qinfer
from qinfer import SamplingParams, generate
from qinfer.cli import build_parser, main
from qinfer.cli.shared import sampling_params
from qinfer.request.chat_defaults import CHAT_DEFAULTS, chat_sampling_params

GREEDY_FLAGS = ["--max-tokens", "6", "--temperature", "0", "--dtype", "float32", "--device", "cpu"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random Llama checkpoint with a ChatML tokenizer."""
    folder = tmp_path_factory.mktemp("llama")
    build_chat_checkpoint(folder, "llama")
    return folder


@pytest.fixture(scope="module")
def paths(folder, tmp_path_factory):
    """Model paths for the bad-input cases: good, missing, and a folder without tokenizer."""
    no_tokenizer = tmp_path_factory.mktemp("no_tokenizer")
    build_checkpoint(no_tokenizer, "llama")
    return dict(folder=folder, missing=no_tokenizer / "missing", no_tokenizer=no_tokenizer)


@pytest.fixture(scope="module")
def loaded(folder):
    return qinfer.load_model(folder, dtype=torch.float32, device="cpu"), qinfer.load_tokenizer(
        folder
    )


def expected_reply(loaded, messages, params: SamplingParams | None = None) -> str:
    """The Python API's reply: `qinfer generate`'s GREEDY_FLAGS by default."""
    model, tokenizer = loaded
    params = params or SamplingParams(temperature=0.0, max_tokens=6)
    return generate(model, tokenizer, messages, params).text


def expected_chat_reply(loaded, folder, messages) -> str:
    """`qinfer chat`'s reply under GREEDY_FLAGS: the chat defaults with temperature 0 and
    6 tokens given."""
    params = chat_sampling_params(folder, temperature=0.0, max_tokens=6)
    return expected_reply(loaded, messages, params)


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qinfer.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_streams_the_chat_completion_to_stdout(folder, loaded):
    done = run_cli("generate", "--model", str(folder), *GREEDY_FLAGS, "Hello there")
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout == expected_reply(loaded, [{"role": "user", "content": "Hello there"}]) + "\n"
    )
    assert "tok/s" in done.stderr


def test_chat_keeps_history_and_reset_forgets_it(folder, loaded):
    turns = "Hello\nHow are you?\n/reset\nHow are you?\n/exit\nnever read\n"
    done = run_cli("chat", "--model", str(folder), *GREEDY_FLAGS, stdin=turns)
    assert done.returncode == 0, done.stderr
    first = expected_chat_reply(loaded, folder, [{"role": "user", "content": "Hello"}])
    history = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "How are you?"},
    ]
    fresh = [{"role": "user", "content": "How are you?"}]
    replies = [
        first,
        expected_chat_reply(loaded, folder, history),
        expected_chat_reply(loaded, folder, fresh),
    ]
    assert done.stdout == "".join(reply + "\n" for reply in replies)


def test_chat_reports_a_turn_too_long_for_the_context_and_goes_on(folder, loaded):
    too_long = "x" * 600  # 600 byte tokens; the context holds 512
    done = run_cli("chat", "--model", str(folder), *GREEDY_FLAGS, stdin=f"{too_long}\nHello\n")
    assert done.returncode == 0, done.stderr
    assert "qinfer: error: " in done.stderr and "context" in done.stderr
    hello = [{"role": "user", "content": "Hello"}]
    assert done.stdout == expected_chat_reply(loaded, folder, hello) + "\n"


def test_sampling_defaults_come_from_the_generation_config_as_the_engine_s(tmp_path):
    """The CLI follows the one rule the engine and server use: without a
    generation_config.json, greedy (transformers' default GenerationConfig)."""
    args = build_parser().parse_args(["generate", "--top-k", "5", "Hi"])
    greedy = SamplingParams(temperature=0.0, top_k=5)
    assert sampling_params(args, tmp_path) == greedy  # no generation_config
    (tmp_path / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6}')
    assert sampling_params(args, tmp_path) == SamplingParams(temperature=0.6, top_k=5)


def test_chat_samples_by_the_chat_defaults_where_generate_is_greedy(tmp_path):
    """Without a generation_config.json, `chat` gets the conversation defaults (the same
    function the server's chat endpoint reads) and `generate` stays greedy; flags win."""
    chat = build_parser().parse_args(["chat", "--seed", "3"])
    assert sampling_params(chat, tmp_path, chat=True) == SamplingParams(**CHAT_DEFAULTS, seed=3)
    generate_args = build_parser().parse_args(["generate", "Hi"])
    assert sampling_params(generate_args, tmp_path).temperature == 0.0
    hot = build_parser().parse_args(["chat", "--temperature", "1.3", "--repetition-penalty", "1"])
    params = sampling_params(hot, tmp_path, chat=True)
    assert (params.temperature, params.repetition_penalty) == (1.3, 1.0)
    # Asked for greedy, chat is greedy as generate is: no penalty added.
    greedy = build_parser().parse_args(["chat", "--temperature", "0"])
    assert sampling_params(greedy, tmp_path, chat=True) == SamplingParams(
        temperature=0.0, max_tokens=CHAT_DEFAULTS["max_tokens"]
    )
    # A checkpoint's own sampling settings win over the chat defaults.
    (tmp_path / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6}')
    assert sampling_params(chat, tmp_path, chat=True).temperature == 0.6


def test_bad_input_in_a_subprocess_is_one_line_and_status_2(tmp_path):
    done = run_cli("generate", "--model", str(tmp_path / "missing"), "Hi")
    assert done.returncode == 2
    assert done.stderr.startswith("qinfer: error: ")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args, names",
    [
        (["generate", "--model", "{missing}", "Hi"], "missing"),
        (["generate", "--model", "{no_tokenizer}", "Hi"], "tokenizer"),
        (["generate", "--model", "{folder}", ""], "empty"),
        (["generate", "--model", "{folder}", "--temperature", "-1", "Hi"], "--temperature"),
        (["generate", "--model", "{folder}", "--top-p", "1.5", "Hi"], "--top-p"),
        (["generate", "--model", "{folder}", "--max-tokens", "0", "Hi"], "--max-tokens"),
        (["generate", "--model", "{folder}", "--max-tokens", "lots", "Hi"], "max-tokens"),
        (["generate", "--model", "{folder}"], "prompt"),
        (["bench", "--model", "{folder}", "--decode-tokens", "1"], "decode_tokens"),
        (["generate", "--model", "{folder}", "--kv-cache-dtype", "int4", "Hi"], "--kv-cache-dtype"),
        (["fly"], "fly"),
    ],
    ids=[
        "unknown-model",
        "no-tokenizer",
        "empty-prompt",
        "negative-temperature",
        "top-p-above-1",
        "zero-max-tokens",
        "non-integer-flag",
        "missing-prompt",
        "bench-too-few-tokens",
        "unknown-kv-cache-dtype",
        "unknown-command",
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_fault(paths, capsys, args, names):
    assert main([arg.format(**paths) for arg in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qinfer: error: ") and err.count("\n") == 1
    assert names in err


def test_bench_json_reports_speeds_and_the_weight_bytes_transformers_counts(folder, capsys):
    from transformers import AutoModelForCausalLM

    flags = ["--prompt-tokens", "8", "--decode-tokens", "3", "--batch-size", "2"]
    assert main(["bench", "--model", str(folder), "--dtype", "float32", *flags, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    figures = report["qinfer"]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    untied = reference.get_input_embeddings().weight  # a decode step reads one row of it
    expected = sum(p.numel() * 4 for p in reference.parameters()) - untied.numel() * 4
    assert figures["weight_bytes_per_step"] == expected
    for name in ("prefill_tokens_per_second", "decode_tokens_per_second", "peak_memory_bytes"):
        assert figures[name] > 0


def test_a_stopped_reply_keeps_only_its_answer_where_the_request_says_the_model_thinks(
    qwen3_chat_folder,
):
    """Ctrl-C mid-reply keeps what was shown; for a thinking model (the prompt leaves the
    `<think>` block for the model to open) only the answer after `</think>`, as the request
    decided when it was made, not by rendering the prompt again."""
    from qinfer import load_model, load_tokenizer
    from qinfer.cli.chat import shown_answer
    from qinfer.engine.generation import stream_generate

    model = load_model(qwen3_chat_folder, dtype="float32", device="cpu")
    tokenizer = load_tokenizer(qwen3_chat_folder)
    stream = stream_generate(model, tokenizer, [{"role": "user", "content": "Hi"}])
    assert stream.prompt_opened_think is False  # a thinking model, block not yet opened
    assert shown_answer(stream, "<think>\nhm\n</think>\n\nHello") == "Hello"
    assert shown_answer(stream, "<think>\nhm") == ""
