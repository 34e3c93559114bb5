"""What the OpenAI-compatible server's tests share (tests/test_server.py,
tests/test_server_errors.py): the planted Qwen3 checkpoint they serve and its tokenizer,
the app `qinfer serve` would run on it (over the real AsyncEngine), the module-scoped
server, `openai` and `httpx` clients of it, and a plain server-sent-events parser.

The checkpoint is random except for one planted path (tests/planted_qwen3.py): after "\\n"
the model always writes `<think>The answer</think>\\n\\nHello<|im_end|>` (a Qwen3 thinking
reply), and after the "\\n\\n" that closes Qwen3's empty think block
(`enable_thinking=False`) it writes `Hello<|im_end|>`. Anywhere else it writes random text
and, in practice, never stops before max_tokens. A test module imports the fixtures
(`fixture_<name>`, which pytest finds under `<name>`), with those they depend on: each
module starts its own server.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI
from planted_qwen3 import build_planted_qwen3
from servers import serving

import qinfer
from qinfer.engine import AsyncEngine
from qinfer.request.sampling import SamplingParams
from qinfer.server.app import ServerSettings, create_app

API_KEY = "test-key"
MODEL_NAME = "tiny-qwen3"
USER = [{"role": "user", "content": "Hello world"}]
# Engine small enough to fill: 8 rows a step, 512 positions of context.
ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=160, max_model_len=512)

PROMPT = "The quick brown fox"


# --- the checkpoint ----------------------------------------------------------------------


@pytest.fixture(scope="module", name="checkpoint")
def fixture_checkpoint(tmp_path_factory) -> Path:
    """A random Qwen3 checkpoint with a Qwen3 tokenizer and chat template, path planted."""
    return build_planted_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module", name="tokenizer")
def fixture_tokenizer(checkpoint):
    return qinfer.load_tokenizer(checkpoint)


# --- the server --------------------------------------------------------------------------


def server_app(checkpoint: Path, tokenizer, **engine_args) -> tuple[FastAPI, AsyncEngine]:
    """The app `qinfer serve` would run on the test checkpoint (float32, an API key, no
    thinking by default), and the engine behind it."""
    engine = AsyncEngine(checkpoint, tokenizer, dtype="float32", **engine_args)
    settings = ServerSettings(
        model_name=MODEL_NAME,
        api_key=API_KEY,
        # Server-wide: answer without thinking unless a request asks for it.
        chat_template_kwargs={"enable_thinking": False},
        default_params=SamplingParams.from_generation_config(checkpoint),
    )
    return create_app(engine, tokenizer, settings), engine


@pytest.fixture(scope="module", name="server")
def fixture_server(checkpoint, tokenizer):
    app, engine = server_app(checkpoint, tokenizer, **ENGINE_ARGS)
    with serving(app=app) as running:
        running.engine = engine
        yield running


@pytest.fixture(scope="module", name="client")
def fixture_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module", name="http")
def fixture_http(server):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as http:
        yield http


# --- a plain server-sent-events parser ---------------------------------------------------


def read_events(response: httpx.Response) -> list[str]:
    """The `data` of each event of a text/event-stream (events end with a blank line)."""
    events, data = [], []
    for line in response.iter_lines():
        if line == "":
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        else:
            assert line.startswith(":"), f"not an SSE line: {line!r}"
    assert not data, "the stream ended inside an event"
    return events


def stream_events(http: httpx.Client, path: str, body: dict) -> list[str]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return read_events(response)


def streamed_text(events: list[str]) -> str:
    """The text of a streamed text completion, from its events."""
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
