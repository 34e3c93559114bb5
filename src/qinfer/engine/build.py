"""Building an engine: what a checkpoint loads with (`LoadConfig`), and the `Engine` made
from a loaded model or a checkpoint (`build_engine`), on one process or a tensor-parallel
group (`follow_engine`: a worker rank's side).

    load = LoadConfig(dtype="float32", device="cpu")
    engine = build_engine("path/to/checkpoint", None, load, {"max_num_seqs": 16})

`LLM`, `AsyncEngine` and `qinfer.server.app.serve` take `LoadConfig`'s fields as keywords
(`LoadConfig.split`); the command line's flags make one (`qinfer.engine.args.load_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from qinfer.core.checkpoint import resolve_model
from qinfer.core.errors import QinferError, TokenizerError
from qinfer.core.features import check_kv_cache_dtype
from qinfer.engine.config import EngineConfig
from qinfer.engine.engine import Engine
from qinfer.model.loading import keeps_gguf_blocks, load_model
from qinfer.model.transformer import Transformer
from qinfer.request.sampling import SamplingParams
from qinfer.runtime.distributed import TensorParallelGroup, init_tensor_parallel, load_on_every_rank
from qinfer.runtime.executor import follow
from qinfer.text.tokenizer import Tokenizer, load_tokenizer
from qinfer.vision.language_model import VisionLanguageModel
from qinfer.vision.load import load_vision
from qinfer.vision.mmproj import check_projector


@dataclass(frozen=True)
class LoadConfig:
    """How a checkpoint loads into an engine.

    dtype, device, quantize, group_size: as for `qinfer.load_model`; kv_cache_dtype: how
    the KV pool stores K/V (None: the model's default, "auto"; "int8" or "fp8" about halve
    its bytes per token: twice the sequences in the same memory); batch_invariant:
    `Features.batch_invariant`; exact: `Features.exact` (fp32 activations into quantized
    weights, the reference mode); tensor_parallel_size: ranks the checkpoint is split over
    (N - 1 worker processes, `qinfer.runtime.distributed`); mmproj: llama.cpp's projector
    file of a Qwen2.5-VL or Qwen3-VL GGUF text model (its vision tower,
    `qinfer.vision.mmproj`)."""

    dtype: str | torch.dtype | None = None
    device: str | torch.device | None = None
    quantize: str | None = None
    group_size: int = 32
    kv_cache_dtype: str | None = None
    batch_invariant: bool = False
    exact: bool = False
    tensor_parallel_size: int = 1
    mmproj: str | Path | None = None

    @classmethod
    def split(
        cls, keywords: dict[str, Any], load: LoadConfig | None = None
    ) -> tuple[LoadConfig, dict[str, Any]]:
        """(a LoadConfig, the other keywords) from a front-end's keywords: those named
        like its fields replace `load`'s (default: every field's default)."""
        names = {field.name for field in dataclasses.fields(cls)}
        own = {name: value for name, value in keywords.items() if name in names}
        rest = {name: value for name, value in keywords.items() if name not in names}
        return dataclasses.replace(load or cls(), **own), rest

    def model_arguments(self) -> dict[str, Any]:
        """`load_model`'s keywords; a kv_cache_dtype of None, batch_invariant and exact
        False are left to the model's defaults."""
        load_args: dict[str, Any] = dict(
            dtype=self.dtype, device=self.device, quantize=self.quantize, group_size=self.group_size
        )
        if self.batch_invariant:
            load_args["batch_invariant"] = True
        if self.exact:
            load_args["exact"] = True
        if self.kv_cache_dtype is not None:
            check_kv_cache_dtype(self.kv_cache_dtype)
            load_args["kv_cache_dtype"] = self.kv_cache_dtype
        return load_args


def build_engine(
    model_or_path: Transformer | VisionLanguageModel | str | Path | None,
    tokenizer: Tokenizer | str | Path | None,
    load: LoadConfig,
    engine_args: dict,
) -> Engine:
    """An Engine from a loaded model (a `VisionLanguageModel`: with its vision tower) or a
    checkpoint (None: the embedded SmolLM2; a path or hub id, as
    `qinfer.core.checkpoint.resolve_model` finds it; a vision-language one's tower and image
    settings are loaded with it, in the model's dtype: a folder's own, or for a GGUF text
    model those of `load.mmproj`), whose tokenizer is loaded too when it has one and none
    is given, and whose generation_config.json gives the sampling defaults of requests that
    bring no SamplingParams. Of a loaded model, only a kv_cache_dtype, batch_invariant or
    exact other than its own is refused (`load`'s other fields are its own).

    tensor_parallel_size N > 1: the checkpoint is split over N ranks; this process is
    rank 0, and the workers are stopped by `Engine.close()`, or when the engine is
    collected or this process exits.
    """
    config = EngineConfig.from_kwargs(**engine_args)
    load_args = load.model_arguments()
    size, mmproj = load.tensor_parallel_size, load.mmproj
    vision = None
    if isinstance(model_or_path, VisionLanguageModel):
        vision, model_or_path = model_or_path, model_or_path.model
    if mmproj is not None and (isinstance(model_or_path, Transformer) or size > 1):
        raise QinferError(
            f"mmproj {mmproj} needs the GGUF text model's path and tensor_parallel_size 1 "
            "(a loaded model brings its own vision tower: VisionLanguageModel.load)"
        )
    if isinstance(model_or_path, Transformer):
        if size != 1:
            raise QinferError(
                "tensor_parallel_size needs a checkpoint, not a loaded model: "
                "every rank loads its own part"
            )
        for name in ("kv_cache_dtype", "batch_invariant", "exact"):
            chosen = load_args.get(name)
            if chosen is not None and chosen != getattr(model_or_path.features, name):
                raise QinferError(
                    f"{name} {chosen!r} is chosen when a model loads: give a "
                    f"checkpoint path, or load the model with that {name}"
                )
        tokenizer = _tokenizer(tokenizer, None)
        return Engine(model_or_path, tokenizer, config, vision=vision)
    path = resolve_model(None if model_or_path is None else str(model_or_path))
    tokenizer = _tokenizer(tokenizer, path)
    default_params = SamplingParams.from_generation_config(path)
    mtp = config.speculative is not None and config.speculative.method == "mtp"
    if size == 1:
        if mmproj is not None:  # a wrong projector fails before the text model loads
            check_projector(mmproj, path)
        model = load_model(path, **load_args, mtp=mtp)
        keep = keeps_gguf_blocks(load.dtype, load.quantize)
        vision = VisionLanguageModel(model, *load_vision(path, model, mmproj, keep))
        return Engine(model, tokenizer, config, default_params, vision=vision)
    if mtp:  # its head would need whole weights beside rank 0's part
        raise QinferError(
            "speculative method 'mtp' runs in one process: use tensor_parallel_size 1"
        )
    if config.lora_modules:  # adapters are not sharded as their base layers are
        raise QinferError(
            "lora_modules: LoRA adapters run in one process: use tensor_parallel_size 1"
        )
    # The workers run the target's steps only: a draft model is rank 0's.
    worker = partial(follow_engine, path, load, dataclasses.replace(config, speculative=None))
    group = init_tensor_parallel(size, load.device, worker)
    model = load_on_every_rank(group, partial(_load_shard, path, load, group))
    return Engine(model, tokenizer, config, default_params, group)


def follow_engine(
    path: Path, load: LoadConfig, config: EngineConfig, group: TensorParallelGroup
) -> None:
    """A worker rank of a tensor-parallel engine: load its shard, size the same pool as
    every rank, and run rank 0's steps until it stops."""
    model = load_on_every_rank(group, partial(_load_shard, path, load, group))
    follow(model, config.runtime, group)


def _load_shard(path: Path, load: LoadConfig, group: TensorParallelGroup) -> Transformer:
    load_args = {**load.model_arguments(), "device": group.device}
    return load_model(path, **load_args, parallel=group.parallel)


def _tokenizer(tokenizer: Tokenizer | str | Path | None, path: Path | None) -> Tokenizer | None:
    """The tokenizer given (or loaded from its path), else the checkpoint's at path, else
    None: a checkpoint without a tokenizer serves token ids only."""
    if isinstance(tokenizer, (str, Path)):
        return load_tokenizer(tokenizer)
    if tokenizer is None and path is not None:
        try:
            return load_tokenizer(path)
        except TokenizerError:
            return None
    return tokenizer
