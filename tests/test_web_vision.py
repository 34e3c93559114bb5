"""The chat page's image attach in a real browser (Debian's Chromium driven by Playwright, as
tests/test_web_chat.py does), against the server `qinfer serve` runs on a tiny random Qwen2.5-VL
checkpoint (tests/test_server_vision.py's, in-process). The reference is the API's own
greedy answer to the same image and text; a text-only model's 400 shows as the page's error.
"""

from __future__ import annotations

import json

import httpx
import pytest
from test_server_vision import IMAGE, build_text_only, build_tiny_vl, data_url, png, vl_app
from web_pages import (
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    TIMEOUT_MS,
    conversation,
    playwright,
    send,
    wait_for_answer,
)

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)"
    ),
]

QUESTION = "What is in the picture?"
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("images") / "picture.png"
    path.write_bytes(png(IMAGE))
    return path


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def open_chat(browser, url: str):
    """A new tab on the chat page, greedy (temperature 0) and at most MAX_TOKENS per answer."""
    context = browser.new_context(base_url=url, viewport={"width": 1280, "height": 860})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    page.goto("/")
    page.fill("#temperature", "0")
    page.dispatch_event("#temperature", "change")
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.dispatch_event("#max-tokens", "change")
    return page


def attach_and_send(page, image_file) -> dict:
    """Attach `image_file` through the file input, send QUESTION with it; the request body."""
    page.set_input_files("#image-input", image_file)
    page.wait_for_selector("#attachments img.thumbnail")
    with page.expect_request("**/v1/chat/completions") as sent:
        send(page, QUESTION)
    return json.loads(sent.value.post_data)


def test_an_attached_image_shows_in_the_message_and_is_answered_as_the_api(
    browser, image_file, tmp_path, serve
):
    build_tiny_vl(tmp_path)
    server = serve(app=vl_app(tmp_path))
    page = open_chat(browser, server.url)
    try:
        body = attach_and_send(page, image_file)
        wait_for_answer(page)
        part = {"type": "image_url", "image_url": {"url": data_url(png(IMAGE))}}
        content = [part, {"type": "text", "text": QUESTION}]
        assert body["messages"] == [{"role": "user", "content": content}]
        # The thumbnail is in the user's bubble, and the composer holds no image any more.
        thumbnail = page.locator(".message.user .bubble img.thumbnail")
        assert thumbnail.count() == 1 and thumbnail.get_attribute("src") == part["image_url"]["url"]
        assert thumbnail.evaluate("img => img.complete && img.naturalWidth") == IMAGE.width
        assert page.locator("#attachments").is_hidden()
        expected = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": body["messages"], "temperature": 0, "max_tokens": MAX_TOKENS},
            timeout=120,
        ).json()["choices"][0]["message"]["content"]
        answer = conversation(page)[-1]
        assert answer["role"] == "assistant" and answer["content"] == expected and expected
        assert page.locator(".message.assistant:last-child .message-footer").is_visible()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=ARTIFACTS / "chat-image.png")
    finally:
        page.context.close()


def test_an_image_sent_to_a_text_only_model_shows_the_servers_error(
    browser, image_file, tmp_path, serve
):
    build_text_only(tmp_path)
    server = serve(app=vl_app(tmp_path))
    page = open_chat(browser, server.url)
    try:
        attach_and_send(page, image_file)
        page.wait_for_selector(".message.error")
        error = page.text_content(".message.error:last-child")
        assert "takes no images" in error and "messages.0.content.0.image_url" in error
        assert page.locator(".message.user .bubble img.thumbnail").count() == 1
    finally:
        page.context.close()
