"""Fixtures shared by several test modules.

Checkpoints and references that cost seconds to build are built once per session and only
read by the tests; what a test may change (a loaded model's features, an engine's KV pool)
stays per module.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import gguf
import pytest
import torch
from checkpoints import WINDOWED, build_chat_checkpoint, load_pair
from gguf_files import smollm2_path
from servers import serving
from text_assets import save_llama3_tokenizer, save_qwen3_tokenizer, tokenizer_pair

from qinfer import kernels


def pytest_configure(config):
    """`make test` runs the suite on two workers (pytest-xdist, a module per worker at a
    time), one per core: each worker and the servers and processes its tests start then
    run one torch thread, so that two workers never share a core between four threads (an
    OpenMP pool that waits on a busy core spins). A test that compares thread counts names
    them (tests/threads.py)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The modules marked slow first, each kept whole and in its order: the two workers
    then end on the short modules together instead of one on a long module alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def qwen3_chat_folder(tmp_path_factory) -> Path:
    """A random Qwen3 checkpoint with the ChatML byte tokenizer (read only)."""
    folder = tmp_path_factory.mktemp("qwen3-chat")
    build_chat_checkpoint(folder, "qwen3")
    return folder


@pytest.fixture(scope="session")
def qwen3_pair(tmp_path_factory):
    """(qinfer tokenizer, transformers tokenizer) over a folder with Qwen3's template (read only)."""
    folder = tmp_path_factory.mktemp("qwen3-tokenizer")
    save_qwen3_tokenizer(folder)
    return tokenizer_pair(folder)


@pytest.fixture(scope="session")
def llama3_pair(tmp_path_factory):
    """(qinfer tokenizer, transformers tokenizer) over a folder with Llama 3.2's template
    (read only)."""
    return tokenizer_pair(save_llama3_tokenizer(tmp_path_factory.mktemp("llama3-tokenizer")))


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed_pair(request, tmp_path_factory):
    """(transformers model, qinfer model in float32) of each WINDOWED family, per module."""
    family, overrides = WINDOWED[request.param]
    return load_pair(tmp_path_factory.mktemp(request.param), family, **overrides)


@pytest.fixture(scope="session")
def smollm2_reader() -> gguf.GGUFReader:
    """The gguf package's reader of the SmolLM2 file (parsing it takes seconds; read only)."""
    return gguf.GGUFReader(smollm2_path())


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    """transformers' tokenizer of the SmolLM2 file, the reference (built in seconds; read only)."""
    from transformers import AutoTokenizer

    path = smollm2_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture
def torch_ops_only(monkeypatch):
    """A context manager: within it, the layers and the paged backend run torch's ops
    (`kernels.SWITCH` off, `kernels.in_use` asked again on entry and on leaving)."""

    @contextlib.contextmanager
    def switched_off():
        with monkeypatch.context() as patched:
            patched.setenv(kernels.SWITCH, "off")
            kernels.in_use.cache_clear()
            try:
                yield
            finally:
                kernels.in_use.cache_clear()

    return switched_off


@pytest.fixture
def serve():
    """`serve(*args, app=None, ...)` -> a `servers.Served`, as `servers.serving` starts it,
    stopped after the test: every server a test stands up goes through `serving`."""
    with contextlib.ExitStack() as stack:
        yield lambda *args, **options: stack.enter_context(serving(*args, **options))


@pytest.fixture
def int8_dot_built() -> None:
    """Skips a test of qinfer's compiled kernels where they cannot be built here."""
    reason = kernels.available()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium driven by Playwright, one per module (tests/web_pages.py; a module
    whose Playwright or Chromium is missing skips before asking for it)."""
    from web_pages import CHROMIUM, CHROMIUM_ARGS, playwright

    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()
