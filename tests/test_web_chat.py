"""The web pages of `qinfer serve` in a real browser (tests/web_pages.py: Debian's Chromium
driven by Playwright), against a real server on the embedded SmolLM2 (nothing mocked): the
chat page at desktop size (the API key, streaming, stop, markup, errors, Markdown, input
methods, a killed server), the inspector, and both pages at phone size (the settings drawer,
the chat history, the page's chat defaults). Screenshots go to tests/artifacts/.
"""

from __future__ import annotations

import contextlib
import json
import re
import time

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

from qinfer.analysis.inspection import MAX_INSPECT_TOKENS

API_KEY = "web-test-key"
PHONE = {"width": 390, "height": 844}
# An answer with what chat answers use: a table, bullets nested in a numbered list, a link,
# a code block.
MARKDOWN_ANSWER = """Here is a **summary**, see [the docs](https://example.com/docs).

| Colour | Wavelength |
|:--|--:|
| red | 700 nm |
| green | 530 nm |

1. First step
   - a detail
   - another detail
2. Second step

```python
def add(a, b):
    return a + b
```"""

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)"
    ),
]


class Server:
    """The module's `qinfer serve` (with an API key), which a test may kill and start again
    on the same port, as a person's server that crashed and came back."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack = stack  # every server started, stopped when the module's tests end
        self.running = stack.enter_context(serving("--api-key", API_KEY))
        self.url = self.running.url

    def kill(self) -> None:
        self.running.process.kill()
        self.running.process.wait(timeout=30)

    def restart(self) -> None:
        port = int(self.url.rsplit(":", 1)[1])
        self.running = self.stack.enter_context(serving("--api-key", API_KEY, port=port))


@pytest.fixture(scope="module")
def web_server():
    with contextlib.ExitStack() as stack:
        yield Server(stack)


@pytest.fixture(scope="module")
def server(web_server):
    return web_server.url


@pytest.fixture(scope="module")
def api(server):
    with httpx.Client(
        base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
    ) as client:
        yield client


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


def horizontal_overflow(page) -> int:
    """How many pixels the page is wider than its window (0: no sideways scrolling)."""
    return page.evaluate("document.documentElement.scrollWidth") - page.viewport_size["width"]


def contrast(foreground: str, background: str) -> float:
    """WCAG's contrast ratio of two CSS rgb() colours (4.5: the minimum for body text)."""

    def luminance(css: str) -> float:
        def linear(c: float) -> float:
            return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

        r, g, b = (linear(int(v) / 255) for v in re.findall(r"\d+", css)[:3])
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    light, dark = sorted((luminance(foreground), luminance(background)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def focused_id(page) -> str:
    return page.evaluate("document.activeElement && document.activeElement.id")


def force_answer(page, text: str):
    """Make the model's next answer in the page exactly `text`: the real server answers,
    only the page's request gains a constraint (guided_choice) that allows nothing else.
    Returns the route handler, for page.unroute."""

    def handler(route):
        body = json.loads(route.request.post_data)
        body["guided_choice"] = [text]
        route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", handler)
    return handler


def test_chat_asks_for_the_key_and_streams_the_greedy_answer(page, api):
    page.goto("/")
    # /v1/models answered 401: the page asks for the key instead of failing silently.
    page.wait_for_selector("#key-bar:not([hidden])")
    page.fill("#key-bar input", API_KEY)
    page.click("#key-bar button")
    model = api.get("/v1/models").json()["data"][0]["id"]
    page.wait_for_function(f"document.getElementById('model-name').textContent === {model!r}")
    assert page.locator("header nav a.current").text_content() == "Chat"
    # The page's own chat defaults, shown in its settings. SmolLM2 does not think: the
    # server says so and the page offers no thinking switch (Qwen3's test sees one).
    defaults = [page.input_value(f"#{field}") for field in ("temperature", "top-p", "max-tokens")]
    assert defaults == ["0.7", "0.9", "1024"]
    assert api.get("/v1/models").json()["data"][0]["thinking"] is False
    assert page.locator("#thinking-setting").is_hidden()

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
    assert focused_id(page) == "prompt"  # the Stop button is gone; typing goes on
    wait_for_metric(api, "qinfer_requests_running", 0)
    wait_for_metric(api, "qinfer_requests_aborted_total", aborted + 1)
    assert "stopped" in page.text_content(".message.assistant:last-child .stats")
    # Stopped text stays, and the next turn still works.
    assert conversation(page)[-1]["content"]


def test_markup_in_answers_and_messages_renders_as_text(page):
    script = "<script>window.injected = 1</script><img src=x onerror='window.injected = 2'>"
    # Also in a code block, which goes through the syntax highlighter's markup.
    handler = force_answer(page, f"{script} and **bold**\n\n```html\n{script}\n```")
    try:
        page.click("#new-chat")
        send(page, f"Repeat: {script}")
        wait_for_answer(page)
    finally:
        page.unroute("**/v1/chat/completions", handler)
    answer = page.locator(".message.assistant:last-child .content")
    assert answer.locator("p").text_content() == f"{script} and bold"
    assert answer.locator("strong").text_content() == "bold"  # Markdown still renders
    code = answer.locator(".code-block code")
    assert code.text_content() == script
    assert code.locator("span.hljs-tag").count() >= 2  # highlighted, yet only text
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


def test_markdown_tables_nested_lists_links_and_code_render(page):
    handler = force_answer(page, MARKDOWN_ANSWER)
    try:
        send(page, "Show me some Markdown.")
        wait_for_answer(page)
    finally:
        page.unroute("**/v1/chat/completions", handler)
    answer = page.locator(".message.assistant:last-child .content")
    assert answer.locator("table th").all_text_contents() == ["Colour", "Wavelength"]
    assert answer.locator("table tbody td").all_text_contents() == [
        "red",
        "700 nm",
        "green",
        "530 nm",
    ]
    assert answer.locator("td").nth(1).evaluate("td => getComputedStyle(td).textAlign") == "right"
    # The bullets under step 1 belong to it: one numbered list of two steps.
    assert answer.locator("ol").count() == 1
    assert answer.locator("ol > li").count() == 2
    bullets = answer.locator("ol > li").first.locator("ul > li")
    assert bullets.all_text_contents() == ["a detail", "another detail"]
    keywords = answer.locator(".code-block code.hljs .hljs-keyword").all_text_contents()
    assert keywords == ["def", "return"]
    link = answer.locator("a")
    assert link.get_attribute("href") == "https://example.com/docs"
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        for scheme in ("light", "dark"):
            page.emulate_media(color_scheme=scheme)
            colours = link.evaluate(
                "a => [getComputedStyle(a).color,"
                " getComputedStyle(a.closest('.bubble')).backgroundColor]"
            )
            assert contrast(*colours) >= 4.5, (scheme, colours)
            page.screenshot(path=ARTIFACTS / f"chat-markdown-{scheme}.png")
    finally:
        page.emulate_media(color_scheme="light")
    assert horizontal_overflow(page) == 0


def test_enter_while_an_input_method_composes_does_not_send(page):
    """Chromium's own IME events (through the DevTools protocol): Enter that ends a
    composition picks the characters and sends nothing; the Enter after it sends."""
    sent = len(conversation(page))
    page.fill("#prompt", "")
    page.focus("#prompt")
    devtools = page.context.new_cdp_session(page)
    devtools.send(
        "Input.imeSetComposition", {"text": "にほ", "selectionStart": 2, "selectionEnd": 2}
    )
    page.keyboard.press("Enter")  # keydown with isComposing: true
    devtools.send("Input.insertText", {"text": "にほんご"})  # the composition ends
    # Some browsers mark the composing Enter only by keyCode 229.
    devtools.send(
        "Input.dispatchKeyEvent",
        {"type": "rawKeyDown", "key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 229},
    )
    assert len(conversation(page)) == sent
    assert page.locator("#send").is_visible()  # nothing is being answered
    assert page.input_value("#prompt").strip() == "にほんご"
    handler = force_answer(page, "OK.")
    try:
        page.press("#prompt", "Enter")
        wait_for_answer(page)
    finally:
        page.unroute("**/v1/chat/completions", handler)
    assert [m["content"] for m in conversation(page)[sent:]] == ["にほんご", "OK."]


def test_a_killed_server_shows_a_retryable_error_and_retry_answers_once_it_is_back(
    page, web_server
):
    page.fill("#max-tokens", "2000")
    page.dispatch_event("#max-tokens", "change")
    send(page, "Write a long story about a dragon.")
    page.wait_for_function(
        "document.querySelector('.message.assistant:last-child .content')?.textContent.length > 10"
    )
    error = page.locator(".message.error:last-child")
    try:
        web_server.kill()
        error.locator(".retry").wait_for()
        assert "connection to the server was lost" in error.text_content()
        # The words that came stay, and the answer can still be asked for again.
        assert conversation(page)[-2]["content"]
        assert page.locator(".message.assistant .regenerate").count() == 1
        # Retry while the server is still gone: told so, with Retry again.
        page.click(".message.error .retry")
        page.wait_for_function(
            "document.querySelector('.message.error:last-child')"
            "?.textContent.includes('Could not reach the server')"
        )
        assert error.locator(".retry").is_visible()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=ARTIFACTS / "chat-server-gone.png")
    finally:
        web_server.restart()
    page.fill("#max-tokens", "20")
    page.dispatch_event("#max-tokens", "change")
    page.click(".message.error .retry")
    wait_for_answer(page)
    last = conversation(page)[-1]
    assert last["role"] == "assistant" and last["content"] and not last.get("error")
    assert page.locator("#messages .message").last.get_attribute("class") == "message assistant"


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
def phone(browser, server):
    """A phone-sized tab that has the key and two earlier conversations: a greeting, and
    (the newest, on the page) the Markdown answer with a long word and a long code line."""
    markdown = (
        MARKDOWN_ANSWER + "\n\nA long word: " + "x" * 80 + "\n\n```\n" + "y = 1; " * 30 + "\n```"
    )
    chats = {
        "current": "b",
        "chats": [
            {
                "id": "a",
                "title": "",
                "named": False,
                "updated": 1,
                "messages": [
                    {"role": "user", "content": "Hello"},
                    {"role": "assistant", "content": "Hi! How can I help?"},
                ],
            },
            {
                "id": "b",
                "title": "",
                "named": False,
                "updated": 2,
                "messages": [
                    {"role": "user", "content": "Show a table and some code"},
                    {"role": "assistant", "content": markdown},
                ],
            },
        ],
    }
    context = browser.new_context(
        base_url=server, viewport=PHONE, is_mobile=True, has_touch=True, device_scale_factor=2
    )
    context.set_default_timeout(TIMEOUT_MS)
    context.add_init_script(
        f"""if (!localStorage.getItem('qinfer.chats'))
            localStorage.setItem('qinfer.chats', {json.dumps(json.dumps(chats))});
        localStorage.setItem('qinfer.apiKey', {json.dumps(API_KEY)});"""
    )
    page = context.new_page()
    yield page
    context.close()


def test_phone_chat_fits_with_its_settings_in_a_drawer(phone):
    phone.goto("/")
    phone.wait_for_selector(".message.assistant table")
    assert focused_id(phone) == "prompt"  # ready to type on load
    assert horizontal_overflow(phone) == 0
    box = phone.locator("#prompt").bounding_box()
    assert box["width"] >= 200
    assert phone.locator("#drawer").is_hidden()
    phone.fill("#prompt", "line\n" * 4)  # the message box grows with its text
    assert phone.locator("#prompt").bounding_box()["height"] > 1.5 * box["height"]
    phone.fill("#prompt", "")
    ARTIFACTS.mkdir(exist_ok=True)
    phone.screenshot(path=ARTIFACTS / "chat-phone.png")

    phone.click("#drawer-button")
    phone.wait_for_function("document.getElementById('drawer').getBoundingClientRect().left === 0")
    assert phone.locator("#drawer").bounding_box()["width"] <= PHONE["width"]
    assert phone.locator("#temperature").is_visible()
    assert horizontal_overflow(phone) == 0
    phone.screenshot(path=ARTIFACTS / "chat-phone-drawer.png")
    titles = phone.locator("#history .chat-title").all_text_contents()
    assert titles == ["Show a table and some code", "Hello"]  # newest first
    phone.click("#history li:nth-child(2) .chat-title")  # switching closes the drawer
    phone.locator("#drawer").wait_for(state="hidden")
    assert phone.locator(".message.user .bubble").all_text_contents() == ["Hello"]


def test_new_chat_keeps_the_old_one_in_the_history_to_rename_and_delete(phone):
    phone.click("#drawer-button")
    phone.click("#new-chat")
    assert phone.locator(".message").count() == 0
    phone.click("#drawer-button")
    titles = phone.locator("#history .chat-title")
    assert titles.all_text_contents() == ["New chat", "Show a table and some code", "Hello"]
    greeting = phone.locator("#history li").nth(2)
    greeting.locator(".rename").click()
    phone.fill("#history .rename-field", "Greetings")
    phone.press("#history .rename-field", "Enter")
    phone.reload()  # names and chats are kept in the browser
    phone.click("#drawer-button")
    assert titles.all_text_contents() == ["New chat", "Show a table and some code", "Greetings"]
    phone.locator("#history li").nth(2).locator(".delete").click()
    assert titles.all_text_contents() == ["New chat", "Show a table and some code"]
    # Deleting the chat on the page shows the newest other one.
    phone.locator("#history li").first.locator(".delete").click()
    assert titles.all_text_contents() == ["Show a table and some code"]
    assert phone.locator(".message.user .bubble").all_text_contents() == [
        "Show a table and some code"
    ]
    phone.click("#drawer-close")


def test_the_page_sends_its_chat_defaults_and_retry_resends(phone):
    """The request a fresh page makes (no setting touched), refused once at the network
    level: a retryable message; Retry sends it again, to the real server."""
    bodies = []

    def refuse(route):
        bodies.append(json.loads(route.request.post_data))
        route.abort()

    phone.route("**/v1/chat/completions", refuse)
    try:
        send(phone, "Hi")
        phone.locator(".message.error .retry").wait_for()
    finally:
        phone.unroute("**/v1/chat/completions", refuse)
    body = bodies[0]
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.7, 0.9, 1024)
    assert "chat_template_kwargs" not in body  # SmolLM2: no thinking switch
    assert "Could not reach the server" in phone.text_content(".message.error")
    phone.screenshot(path=ARTIFACTS / "chat-phone-error.png")
    phone.click("#drawer-button")
    phone.fill("#max-tokens", "8")  # a short answer is enough
    phone.dispatch_event("#max-tokens", "change")
    phone.click("#drawer-close")
    phone.click(".message.error .retry")
    wait_for_answer(phone)
    assert conversation(phone)[-1]["content"] and phone.locator(".message.error").count() == 0
    assert horizontal_overflow(phone) == 0


def test_phone_inspector_fits(phone):
    phone.goto("/inspect")
    phone.click("#inspect")
    phone.wait_for_selector("#results:not([hidden])")
    assert horizontal_overflow(phone) == 0
    assert phone.locator("#heatmap").bounding_box()["width"] <= PHONE["width"]
    phone.screenshot(path=ARTIFACTS / "inspect-phone.png", full_page=True)
