"""The web pages of `qinfer serve` in a real browser: Debian's Chromium driven by Playwright,
against a real server on the embedded SmolLM2 (nothing mocked).

Screenshots of both pages go to tests/artifacts/ (not committed) for a person to look at.
Chromium comes from apt (`.ci/run` installs it); Playwright's own browser download is
never used.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from server_process import start_serve_command

import qinfer
from qinfer.inspection import MAX_INSPECT_TOKENS

playwright = pytest.importorskip("playwright.sync_api")

CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking switches Chromium's own connections (updates, sync,
# field trials) are refused on a closed network and slow every page down.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).parent / "artifacts"
API_KEY = "web-test-key"
QUESTION = "Name three colours of the rainbow."
TIMEOUT_MS = 120_000

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)"
)


@pytest.fixture(scope="module")
def server():
    process, url = start_serve_command("--api-key", API_KEY, timeout=120)
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def api(server):
    with httpx.Client(
        base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
    ) as client:
        yield client


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(browser, server):
    """One tab for the module: the key, once entered, stays in its localStorage."""
    context = browser.new_context(base_url=server, viewport={"width": 1280, "height": 860})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    yield page
    context.close()


def metric(api: httpx.Client, name: str) -> float:
    for line in api.get("/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"/metrics has no {name}")


def wait_for_metric(api: httpx.Client, name: str, value: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while metric(api, name) != value:
        assert time.monotonic() < deadline, f"{name} stayed at {metric(api, name)}, not {value}"
        time.sleep(0.05)


def conversation(page) -> list[dict]:
    return json.loads(page.evaluate("localStorage.getItem('qinfer.chat')") or "[]")


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def watch_answer(page, snapshot: str) -> None:
    """From now on, each time the conversation changes, append `snapshot` (a JavaScript
    expression over `last`, the last assistant message) to `window.seen`, unless it is
    empty: what a person would have seen while the answer streamed."""
    page.evaluate(
        f"""() => {{
        window.seen = [];
        new MutationObserver(() => {{
            const last = document.querySelector('.message.assistant:last-child');
            const value = last && ({snapshot});
            if (value) window.seen.push(value);
        }}).observe(document.getElementById('messages'), {{subtree: true, childList: true,
                                                          characterData: true}});
    }}"""
    )


def wait_for_answer(page) -> None:
    """Until the answer being streamed has finished (its footer shows)."""
    page.wait_for_selector("#send:not([hidden])")
    page.wait_for_selector(".message.assistant:last-child .message-footer")


def test_chat_asks_for_the_key_and_streams_the_greedy_answer(page, api):
    page.goto("/")
    # /v1/models answered 401: the page asks for the key instead of failing silently.
    page.wait_for_selector("#key-bar:not([hidden])")
    page.fill("#key-bar input", API_KEY)
    page.click("#key-bar button")
    model = api.get("/v1/models").json()["data"][0]["id"]
    page.wait_for_function(f"document.getElementById('model-name').textContent === {model!r}")
    assert page.locator("header nav a.current").text_content() == "Chat"

    page.fill("#temperature", "0")
    page.fill("#max-tokens", "40")
    page.dispatch_event("#max-tokens", "change")
    # The answer's length each time the page changes it, to see it arrive in pieces.
    watch_answer(page, "last.querySelector('.content')?.textContent.length")
    send(page, QUESTION)
    wait_for_answer(page)

    seen = page.evaluate("window.seen")
    assert len({n for n in seen if n > 0}) >= 3, f"the answer did not stream: {seen}"
    answer = conversation(page)[-1]
    expected = api.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0,
            "max_tokens": 40,
        },
    ).json()["choices"][0]["message"]["content"]
    assert answer["role"] == "assistant" and answer["content"] == expected
    stats = page.text_content(".message.assistant:last-child .stats")
    assert "TTFT" in stats and "tok/s" in stats and "40 tokens" in stats
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=ARTIFACTS / "chat.png")


def test_stop_aborts_the_request_on_the_server(page, api):
    aborted = metric(api, "qinfer_requests_aborted_total")
    page.fill("#max-tokens", "2000")
    page.dispatch_event("#max-tokens", "change")
    send(page, "Write a long story about a lighthouse keeper.")
    page.wait_for_function(
        "document.querySelector('.message.assistant:last-child .content')?.textContent.length > 10"
    )
    assert metric(api, "qinfer_requests_running") == 1
    page.click("#stop")
    wait_for_answer(page)
    wait_for_metric(api, "qinfer_requests_running", 0)
    wait_for_metric(api, "qinfer_requests_aborted_total", aborted + 1)
    assert "stopped" in page.text_content(".message.assistant:last-child .stats")
    # Stopped text stays, and the next turn still works.
    assert conversation(page)[-1]["content"]


def test_markup_in_answers_and_messages_renders_as_text(page):
    script = "<script>window.injected = 1</script><img src=x onerror='window.injected = 2'>"

    def force_answer(route):
        # The real server answers; only the request gains a constraint that makes the
        # model's answer exactly this markup.
        body = json.loads(route.request.post_data)
        body["guided_choice"] = [f"{script} and **bold**"]
        route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", force_answer)
    try:
        page.click("#new-chat")
        send(page, f"Repeat: {script}")
        wait_for_answer(page)
    finally:
        page.unroute("**/v1/chat/completions")
    answer = page.locator(".message.assistant:last-child .content")
    assert answer.text_content() == f"{script} and bold"
    assert answer.locator("strong").text_content() == "bold"  # Markdown still renders
    user = page.locator(".message.user .bubble").last
    assert user.text_content() == f"Repeat: {script}"
    assert page.locator("#messages script, #messages img").count() == 0
    assert page.evaluate("window.injected") is None


def test_server_errors_show_as_messages(page):
    page.fill("#top-p", "7")  # out of range: the server answers 400 naming top_p
    page.dispatch_event("#top-p", "change")
    send(page, "Hello")
    page.wait_for_selector(".message.error")
    assert "top_p" in page.text_content(".message.error:last-child")
    page.fill("#top-p", "")
    page.dispatch_event("#top-p", "change")


def heatmap_colours(page) -> int:
    """How many distinct colours the heatmap canvas holds (a blank canvas: one)."""
    return page.evaluate(
        """() => {
        const canvas = document.getElementById('heatmap');
        const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        const colours = new Set();
        for (let i = 0; i < data.length; i += 4) colours.add(data[i] << 16 | data[i+1] << 8 | data[i+2]);
        return colours.size;
    }"""
    )


def test_inspector_draws_the_heatmap_and_the_next_token_bars(page, api):
    page.goto("/inspect")
    page.fill("#prompt", "The capital of France is Paris, and the capital of Italy is")
    page.select_option("#layer", "0")
    page.fill("#top-k", "5")
    page.click("#inspect")
    page.wait_for_selector("#results:not([hidden])")
    assert page.locator("header nav a.current").text_content() == "Inspector"
    assert heatmap_colours(page) > 20
    heads = api.post("/v1/inspect", json={"prompt": "x"}).json()["num_heads"]
    assert page.locator(".head-thumb").count() == heads
    assert page.locator("#bars .bar").count() == 5
    top = page.locator("#bars .bar-label").first.text_content()
    assert top == "·Rome"  # the page shows a token's space as "·"
    assert (
        page.locator("#lens tr").count()
        == 1 + api.post("/v1/inspect", json={"prompt": "x"}).json()["num_layers"]
    )
    page.click(".head-thumb:nth-child(3)")
    assert "head 2" in page.text_content("#attention-title")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=ARTIFACTS / "inspect.png", full_page=True)


def test_inspector_shows_a_refused_request_as_an_error(page):
    page.fill("#prompt", "word " * (MAX_INSPECT_TOKENS + 1))
    page.click("#inspect")
    page.wait_for_selector("#status.error")
    assert f"inspection takes 1 to {MAX_INSPECT_TOKENS}" in page.text_content("#status")


@pytest.fixture(scope="module")
def qwen3_server(qwen3_chat_folder):
    """`qinfer serve` on a random Qwen3 whose tokenizer has Qwen3's <think> tags."""
    process, url = start_serve_command("--model", str(qwen3_chat_folder), timeout=120)
    yield url
    process.terminate()
    process.wait(timeout=30)


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
