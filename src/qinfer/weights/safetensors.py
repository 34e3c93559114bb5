"""Hugging Face safetensors checkpoints: one `model.safetensors` or shards with an index."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from qinfer.core.checkpoint import read_json_object
from qinfer.core.errors import WeightsError
from qinfer.weights.base import ALL, Weights

INDEX_FILE = "model.safetensors.index.json"
#: Where a multimodal checkpoint (Gemma 3 with its vision tower) keeps its text model,
#: by the transformers version that saved it: read under the text model's own names
#: (`model.layers.0...`); the vision tower's tensors are never read. A Qwen3.5 MTP head
#: saved under the model (`model.mtp.*`, as llama.cpp's converter also reads it) is `mtp.*`.
TEXT_MODEL_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.mtp.": "mtp.",
}


def text_model_name(stored: str) -> str:
    """Our name for a stored tensor name (itself, unless a multimodal text-model prefix)."""
    for prefix, ours in TEXT_MODEL_PREFIXES.items():
        if stored.startswith(prefix):
            return ours + stored[len(prefix) :]
    return stored


class SafetensorsWeights(Weights):
    """Tensors read lazily and memory-mapped from the `.safetensors` files of a folder; a
    tensor-parallel rank's part of a tensor is read alone (`get_slice`)."""

    def __init__(
        self,
        folder: str | Path,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(dtype, device)
        self.folder = Path(folder)
        self._file_of: dict[str, Path] = {}
        self._stored_name: dict[str, str] = {}  # our name -> the name in the file
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map = read_json_object(index, WeightsError).get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()
            ):
                raise WeightsError(
                    f"{index} is not a valid safetensors index: weight_map must map "
                    "tensor names to file names"
                )
            files = sorted({self.folder / f for f in weight_map.values()})
        else:
            files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"no .safetensors files found in {self.folder}")
        self._handles = {}
        for file in files:
            if not file.is_file():
                raise WeightsError(f"weight file {file} listed in {index.name} does not exist")
            try:
                handle = safe_open(str(file), framework="pt")
                keys = list(handle.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise WeightsError(f"corrupt safetensors file {file}: {e}") from None
            self._handles[file] = handle
            for key in keys:
                name = text_model_name(key)
                self._file_of[name], self._stored_name[name] = file, key
        self._files = files

    def names(self) -> list[str]:
        return list(self._file_of)

    def where(self, name: str) -> str:
        if name in self._file_of:
            return str(self._file_of[name])
        return ", ".join(str(f) for f in self._files)

    def _shape(self, name: str) -> tuple[int, ...]:
        stored = self._stored_name[name]
        return tuple(self._handles[self._file_of[name]].get_slice(stored).get_shape())

    def _read(self, name: str, rows: slice = ALL, columns: slice = ALL) -> torch.Tensor:
        """The tensor, or only the bytes of its rows and columns (`get_slice`)."""
        file, key = self._file_of[name], self._stored_name[name]
        try:
            if rows == ALL and columns == ALL:
                return self._handles[file].get_tensor(key)
            stored = self._handles[file].get_slice(key)
            return stored[rows] if len(stored.get_shape()) == 1 else stored[rows, columns]
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise WeightsError(f"cannot read tensor {key!r} from {file}: {e}") from None
