"""The chat page's reasoning block in a real browser (tests/web_pages.py: Debian's Chromium
driven by Playwright), against `qinfer serve` on a random Qwen3 whose tokenizer has Qwen3's
<think> tags: the reasoning streams into a collapsible block apart from the answer, as the
API's own greedy answer to the same request has them. Screenshots go to tests/artifacts/.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from servers import serving
from web_pages import (
    ARTIFACTS,
    CHROMIUM,
    QUESTION,
    TIMEOUT_MS,
    conversation,
    send,
    wait_for_answer,
    watch_answer,
)

import qinfer

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)"
    ),
]


@pytest.fixture(scope="module")
def qwen3_server(qwen3_chat_folder):
    """`qinfer serve` on a random Qwen3 whose tokenizer has Qwen3's <think> tags."""
    with serving("--model", str(qwen3_chat_folder)) as running:
        yield running.url


def thinking_grammar(folder: Path) -> str:
    """A Lark grammar for a reply as Qwen3 writes one when it thinks: the `<think>` token,
    free reasoning, `</think>`, then a free answer (the tags by id: llguidance matches
    added tokens only by id). Free parts keep the model's own greedy choices."""
    tokenizer = qinfer.load_tokenizer(folder)
    think_open, think_close = (tokenizer.token_to_id(t) for t in ("<think>", "</think>"))
    return (
        f'start: <[{think_open}]> "\\n" REASONING "\\n" <[{think_close}]> "\\n\\n" ANSWER\n'
        "REASONING: /[a-z][a-z ]{80,160}[a-z]/\n"
        "ANSWER: /[A-Z][a-z ,]{10,30}[.]/\n"
    )


def test_reasoning_streams_into_a_collapsible_block_apart_from_the_answer(
    browser, qwen3_server, qwen3_chat_folder
):
    """The real server's reasoning_content deltas: a random Qwen3 is made to think by a
    grammar the test adds to the page's request (thinking off, so the prompt closes the
    block and the grammar applies from the first token, `<think>` included)."""
    grammar = thinking_grammar(qwen3_chat_folder)

    def force_thinking(route):
        body = json.loads(route.request.post_data)
        body["guided_grammar"] = grammar
        route.continue_(post_data=json.dumps(body))

    context = browser.new_context(base_url=qwen3_server, viewport={"width": 1280, "height": 860})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    try:
        page.route("**/v1/chat/completions", force_thinking)
        page.goto("/")
        page.fill("#temperature", "0")
        page.dispatch_event("#temperature", "change")
        # The server says this model thinks: the page offers the switch.
        assert httpx.get(f"{qwen3_server}/v1/models").json()["data"][0]["thinking"] is True
        page.select_option("#thinking", "off")
        # Each change of the page: [reasoning shown, answer shown, the block's label, open].
        watch_answer(
            page,
            """(block => block && [block.querySelector('.reasoning-text').textContent.length,
                                  last.querySelector('.content').textContent.length,
                                  block.querySelector('summary').textContent, block.open]
               )(last.querySelector('details.reasoning'))""",
        )
        send(page, QUESTION)
        wait_for_answer(page)
        seen = page.evaluate("window.seen")
        reply = api_reply(qwen3_server, grammar)
        # While the model thought, its reasoning showed in an open "Thinking…" block with no
        # answer yet (how much of it arrived per frame depends on the machine's speed).
        thinking = [r and not a and label == "Thinking…" and shown for r, a, label, shown in seen]
        assert any(thinking), seen
        last = page.locator(".message.assistant:last-child")
        block = last.locator("details.reasoning")
        assert block.locator("summary").text_content() == "Thought"
        assert not block.evaluate("details => details.open")  # folded once the answer came
        assert block.locator(".reasoning-text").text_content() == reply["reasoning_content"]
        assert last.locator(".content").text_content() == reply["content"]
        assert "<think>" not in last.text_content() and reply["content"]
        saved = conversation(page)[-1]
        assert (saved["reasoning"], saved["content"]) == (
            reply["reasoning_content"],
            reply["content"],
        )
        block.locator("summary").click()
        assert block.evaluate("details => details.open")
        assert block.locator(".reasoning-text").is_visible()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=ARTIFACTS / "chat-reasoning.png")
    finally:
        context.close()


def api_reply(url: str, grammar: str) -> dict:
    """The API's greedy answer to the page's request (thinking off, the same grammar)."""
    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
        "guided_grammar": grammar,
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    return response.json()["choices"][0]["message"]
