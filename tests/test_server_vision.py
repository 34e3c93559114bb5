"""Images through the server (`qinfer.server.images`): OpenAI chat `image_url` parts,
Responses `input_image` parts and Anthropic `image` blocks, sent with the real `openai`
and `anthropic` clients to the app `qinfer serve` runs, over the real AsyncEngine on a tiny
random Qwen2.5-VL checkpoint (tests/test_vl_engine.py's). The reference is `LLM.generate`
offline with the same image and text; every bad image is a one-line 400 naming its part,
in each API's error shape, after which the engine holds no KV block.
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import openai
import pytest
from checkpoints import build_checkpoint
from fastapi import FastAPI
from servers import serving, wait_until_idle
from test_vl_engine import SPECIAL, VL_TEMPLATE, VOCAB, save_vl_tokenizer
from test_vl_models import TEXT, make_image, save_vl_checkpoint

import qinfer
from qinfer import LLM, SamplingParams
from qinfer.cli import build_parser
from qinfer.core.errors import QinferError
from qinfer.engine import AsyncEngine
from qinfer.server.app import ServerSettings, create_app
from qinfer.server.errors import APIError
from qinfer.server.images import ImageReader, ImageRef

MODEL = "tiny-vl"
#: A context of 128 positions: a 448 x 448 image (256 tokens) cannot fit.
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=128, max_model_len=128)
MAX_TOKENS = 5
IMAGE = make_image(112, 84, 0)  # 12 tokens
QUESTION = "What is it?"


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def ppm(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PPM")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def huge_png() -> bytes:
    """A PNG whose header says 30000 x 30000 pixels (its IHDR rewritten, CRC fixed)."""
    data = bytearray(png(make_image(8, 8, 0)))
    ihdr = bytearray(data[12:29])  # b"IHDR" + 13 bytes
    ihdr[4:12] = struct.pack(">II", 30000, 30000)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(ihdr))
    return bytes(data)


# --- the checkpoint and the servers ------------------------------------------------------


def build_tiny_vl(folder) -> None:
    """A random Qwen2.5-VL checkpoint with its preprocessor and a Qwen-VL tokenizer in
    `folder` (tests/test_vl_engine.py's sizes and tokens)."""
    save_vl_checkpoint(folder, "qwen2.5-vl", dict(TEXT, vocab_size=VOCAB), SPECIAL)
    save_vl_tokenizer(folder, VL_TEMPLATE)


def build_text_only(folder) -> None:
    """A random Qwen3 (no vision tower) with the same tokenizer."""
    build_checkpoint(folder, "qwen3", vocab_size=VOCAB)
    save_vl_tokenizer(folder, VL_TEMPLATE)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-vl")
    build_tiny_vl(folder)
    return folder


def vl_app(folder, **settings) -> FastAPI:
    """The server's app over the checkpoint in `folder` (served in process by the tests)."""
    tokenizer = qinfer.load_tokenizer(folder)
    engine = AsyncEngine(folder, tokenizer, **ENGINE)
    return create_app(engine, tokenizer, ServerSettings(model_name=MODEL, **settings))


class ImageHost:
    """A loopback HTTP server: GET /cat.png is the image, anything else a 404."""

    def __init__(self, body: bytes):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                found = self.path == "/cat.png"
                self.send_response(200 if found else 404)
                self.send_header("Content-Length", str(len(body) if found else 0))
                self.end_headers()
                if found:
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def image_host():
    host = ImageHost(png(IMAGE))
    yield host
    host.server.shutdown()


@pytest.fixture(scope="module")
def server(folder):
    # The loopback host is allowed: its images are fetched (the machines have no internet).
    with serving(app=vl_app(folder, allowed_media_domains=("127.0.0.1",))) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def expected(folder) -> str:
    """The reference: `LLM.generate` offline on the same image and question, greedy."""
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": png(IMAGE)}, {"type": "text", "text": QUESTION}],
        }
    ]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    [out] = LLM(folder, **ENGINE).generate(messages, params, use_tqdm=False)
    return out.text


def chat_image(client, url: str, question: str = QUESTION):
    return client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": question},
                ],
            }
        ],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )


# --- the same answer through every API ---------------------------------------------------


def test_chat_completions_with_a_data_url_answer_as_the_offline_engine(client, expected):
    answer = chat_image(client, data_url(png(IMAGE)))
    assert answer.choices[0].message.content == expected
    assert answer.usage.prompt_tokens > 12  # the image's run of 12 tokens, not one placeholder


def test_a_streamed_chat_completion_with_an_image_answers_the_same(client, expected):
    url = data_url(png(IMAGE))
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


def test_responses_with_an_input_image_answer_as_the_offline_engine(client, expected):
    answer = client.responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(png(IMAGE)), "detail": "auto"},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
        temperature=0,
        max_output_tokens=MAX_TOKENS,
    )
    assert answer.output_text == expected


def test_messages_with_a_base64_image_block_answer_as_the_offline_engine(claude, expected):
    source = {"type": "base64", "media_type": "image/png", "data": data_url(png(IMAGE))[22:]}
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},  # the client no longer takes it; the API does
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": source},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
    )
    assert answer.content[0].text == expected


def test_an_image_url_of_an_allowed_host_is_fetched(client, image_host, expected):
    answer = chat_image(client, f"{image_host.url}/cat.png")
    assert answer.choices[0].message.content == expected


# --- bad images: a 400 naming the part, nothing held --------------------------------------

PART = "messages.0.content.0.image_url"
BAD_IMAGE_URLS = {
    "https://example.com/cat.png": "--allowed-media-domains does not name it",
    "file:///etc/passwd": "must be a data URL or an http(s) URL",
    "http://[abc/x.png": "not a valid URL",  # urlsplit raises on the open IPv6 bracket
    data_url(ppm(IMAGE)): "not an image file",  # PPM: a format Pillow reads, not one of ours
    data_url(b"hello", "text/plain"): "not an image",
    "data:image/png;base64,***": "not valid base64",
    data_url(b"\x00" * 64): "not an image file",
    data_url(png(IMAGE)[:300]): "truncated or corrupt",
    data_url(huge_png()): "pixel limit",
    data_url(png(make_image(448, 448, 3))): "prompt has",  # 256 image tokens, context 128
}


@pytest.mark.parametrize("url", BAD_IMAGE_URLS, ids=range(len(BAD_IMAGE_URLS)))
def test_a_bad_chat_image_is_a_400_naming_its_part(client, http, url):
    with pytest.raises(openai.BadRequestError) as caught:
        chat_image(client, url)
    error = caught.value.body
    assert BAD_IMAGE_URLS[url] in error["message"] and "\n" not in error["message"]
    if BAD_IMAGE_URLS[url] != "prompt has":  # the context holds the prompt, not one image
        assert error["param"] == PART and PART in error["message"]
    assert wait_until_idle(http)["qinfer_kv_blocks_used"] == 0


def test_an_unfetchable_allowed_url_is_a_400_naming_its_part(client, image_host):
    with pytest.raises(openai.BadRequestError, match="answered HTTP 404") as caught:
        chat_image(client, f"{image_host.url}/missing.png")
    assert caught.value.body["param"] == PART


def test_bad_responses_images_are_400s_naming_their_part(client):
    content = [{"type": "input_text", "text": "Hi"}, {"type": "input_image", "image_url": ""}]
    for image, reason in [
        ({"image_url": "https://example.com/a.png"}, "input.0.content.1.image_url"),
        ({"image_url": data_url(png(IMAGE)), "file_id": "file-1"}, "OpenAI-hosted"),
    ]:
        content[1] = {"type": "input_image", **image}
        with pytest.raises(openai.BadRequestError, match=reason):
            client.responses.create(
                model=MODEL, input=[{"role": "user", "content": content}], max_output_tokens=2
            )


def test_bad_anthropic_images_are_400s_in_its_shape_naming_their_part(claude, http):
    sources = {
        "messages.0.content.0.source.data": {
            "type": "base64",
            "media_type": "image/png",
            "data": data_url(png(IMAGE)[:300])[22:],
        },
        "messages.0.content.0.source.url": {"type": "url", "url": "https://example.com/a.png"},
        "messages.0.content.0.source.media_type": {
            "type": "base64",
            "media_type": "application/pdf",
            "data": "AAAA",
        },
    }
    for field, source in sources.items():
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(
                model=MODEL,
                max_tokens=2,
                messages=[{"role": "user", "content": [{"type": "image", "source": source}]}],
            )
        assert caught.value.body["type"] == "error"
        assert field in caught.value.body["error"]["message"]
    assert wait_until_idle(http)["qinfer_kv_blocks_used"] == 0


def test_an_image_sent_to_a_text_only_model_is_a_400_naming_its_part(tmp_path, serve):
    build_text_only(tmp_path)
    running = serve(app=vl_app(tmp_path))
    text_only = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="takes no images") as caught:
        chat_image(text_only, data_url(png(IMAGE)))
    assert caught.value.body["param"] == PART
    # /tokenize of the same chat: refused alike, not the placeholder text's tokens
    image_part = {"type": "image_url", "image_url": {"url": data_url(png(IMAGE))}}
    body = {"messages": [{"role": "user", "content": [image_part]}]}
    answer = httpx.post(f"{running.url}/tokenize", json=body, timeout=60)
    assert answer.status_code == 400 and "takes no images" in answer.text


# --- the allow-list ------------------------------------------------------------------------


def test_allowed_media_domains_parse_as_lowercase_host_names():
    args = build_parser().parse_args(
        ["serve", "--allowed-media-domains", "Images.Example.com", "cdn.example.org"]
    )
    assert args.allowed_media_domains == ["images.example.com", "cdn.example.org"]
    with pytest.raises(QinferError, match="--allowed-media-domains: takes host names"):
        build_parser().parse_args(["serve", "--allowed-media-domains", "https://example.com/"])


def test_a_url_is_fetched_only_from_an_allowed_host_and_up_to_the_size_cap(image_host):
    ref = ImageRef("image", f"{image_host.url}/cat.png")
    with pytest.raises(APIError, match="are not fetched"):
        asyncio.run(ImageReader(["localhost"]).read(ref))
    with pytest.raises(APIError, match="over 100 bytes"):
        asyncio.run(ImageReader(["127.0.0.1"], max_bytes=100).read(ref))
    assert asyncio.run(ImageReader(["127.0.0.1"]).read(ref)).size == IMAGE.size
