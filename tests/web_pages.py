"""What tests/test_web_*.py (and tests/test_web_vision.py) share to drive the web pages of
`qinfer serve` in a real browser: Debian's Chromium (from apt; `.ci/run` installs it, and
Playwright's own browser download is never used) driven by Playwright, where screenshots go
(tests/artifacts/, not committed, for a person to look at), and what a test does on the chat
page and reads off it. The `browser` fixture (conftest) launches the Chromium.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
QUESTION = "Name three colours of the rainbow."
TIMEOUT_MS = 120_000


def conversation(page) -> list[dict]:
    """The messages of the conversation on the page, as the page stored them."""
    stored = json.loads(page.evaluate("localStorage.getItem('qinfer.chats')"))
    return next(chat for chat in stored["chats"] if chat["id"] == stored["current"])["messages"]


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
