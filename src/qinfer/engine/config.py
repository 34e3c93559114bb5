"""The knobs of the serving engine, checked once when the engine starts."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from qinfer.core.errors import QinferError
from qinfer.core.features import check_attention_backend, check_lora_dtype
from qinfer.core.model_config import ModelConfig
from qinfer.engine.speculative.config import SpeculativeConfig
from qinfer.runtime.config import RuntimeConfig

log = logging.getLogger("qinfer.engine")

#: What a size's suffix multiplies by (decimal and binary units, case ignored).
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
SIZE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_byte_size(text: str | int) -> int:
    """Bytes from an int or a text such as "10GB", "512MiB", "2e9" (ValueError: not a
    positive size)."""
    stripped = str(text).strip().lower()
    unit = stripped.lstrip("0123456789.e+_")
    try:
        number = float(stripped[: len(stripped) - len(unit)])
    except ValueError:
        number = math.nan
    if isinstance(text, bool) or unit.strip() not in SIZE_UNITS or not 0 < number < math.inf:
        raise ValueError(f"must be a size such as 10GB or 512MiB, got {text!r}")
    return int(number * SIZE_UNITS[unit.strip()])


#: The disk tier's default bound (`EngineConfig.prompt_cache_size`).
DEFAULT_PROMPT_CACHE_SIZE = 10 * 10**9


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches requests and how much memory its KV pool takes.

    block_size: tokens per KV block (the unit of allocation and of prefix sharing).
    max_num_seqs: sequences in one step (decoding or prefilling).
    max_num_batched_tokens: tokens run through the model in one step (decode tokens
        plus prefill chunks); long prompts are prefilled in chunks of at most this.
    kv_cache_memory: bytes for the KV pool (and a hybrid model's recurrent-state slots, at
        most half of it: `runtime.runner.state_slots`); default: gpu_memory_utilization of the free
        device memory on GPU, `runtime.config.DEFAULT_CPU_KV_MEMORY` on CPU.
    num_kv_blocks: exact pool size in blocks; overrides kv_cache_memory.
    max_model_len: longest sequence (prompt + output); default the model's context.
    enable_prefix_caching: reuse the K/V of full blocks shared by several prompts (and, for
        a hybrid model, the snapshots of its recurrent state: `engine.block_manager`).
    state_snapshots: a hybrid model's prefix cache: how many recurrent-state snapshots it
        keeps (rows of `attention.state_pool.StatePool`, out of kv_cache_memory); None: as
        many as a quarter of the budget holds, at most max_num_seqs (max_num_seqs beside
        num_kv_blocks); 0: none, so that no prompt of a hybrid model finds a cached prefix.
    max_waiting_requests: requests allowed to wait; more are refused as overloaded.
    attention_backend: how the runner keeps K/V and attends (`qinfer.attention.backend`):
        auto (by device), paged (the CPU's) or gathered (one sdpa call over gathered blocks).
    static_decode: decode steps padded to buckets of batch sizes and table widths, each
        bucket one set of shapes with no tensor made per step (`qinfer.runtime.static_decode`;
        the gathered backend's: auto picks it).
    cuda_graphs: replay each decode bucket's step as a CUDA graph (`qinfer.runtime.cuda_graphs`;
        it implies static_decode); None: on with a CUDA device, False: eager everywhere.
    speculative: speculative decoding (`qinfer.engine.speculative.SpeculativeConfig`, or a mapping
        of its settings); None: off.
    lora_modules: LoRA adapters loaded at start, name -> PEFT folder or GGUF adapter file; a
        request names one (`Engine.make_request`'s lora), more load at run time.
    max_loras: adapters resident at once (more may be loaded: the least recently used one
        not in use is evicted, `qinfer.lora.adapters`); max_lora_rank: the largest rank;
        lora_dtype: what they are held in (`qinfer.lora.adapters.adapter_dtype`: auto,
        float32 or bfloat16).
    prompt_cache_dir: a folder for the prefix cache's disk tier (`qinfer.engine.disk_cache`:
        full blocks of finished prompts, read back by a restarted engine or another
        process); None: memory only. prompt_cache_size: the most bytes it holds (an int, or
        a text such as "10GB").
    """

    block_size: int = RuntimeConfig.block_size
    max_num_seqs: int = RuntimeConfig.max_num_seqs
    max_num_batched_tokens: int = RuntimeConfig.max_num_batched_tokens
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = RuntimeConfig.gpu_memory_utilization
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    state_snapshots: int | None = None
    max_waiting_requests: int = 1024
    attention_backend: str = RuntimeConfig.attention_backend
    static_decode: bool = RuntimeConfig.static_decode
    cuda_graphs: bool | None = RuntimeConfig.cuda_graphs
    speculative: SpeculativeConfig | None = None
    lora_modules: dict[str, str] | None = None
    max_loras: int = 4
    max_lora_rank: int = 64
    lora_dtype: str = "auto"
    prompt_cache_dir: str | Path | None = None
    prompt_cache_size: int | str = DEFAULT_PROMPT_CACHE_SIZE

    def __post_init__(self) -> None:
        # a mapping of settings (`LLM(..., speculative={...})`) becomes its config
        object.__setattr__(self, "speculative", SpeculativeConfig.create(self.speculative))
        positive = ["block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests"]
        positive += ["kv_cache_memory", "num_kv_blocks", "max_model_len"]
        positive += ["max_loras", "max_lora_rank"]
        for name in positive:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise QinferError(
                    f"engine argument {name} must be a positive integer, got {value!r}"
                )
        snapshots = self.state_snapshots
        if snapshots is not None and (not isinstance(snapshots, int) or snapshots < 0):
            raise QinferError(
                f"engine argument state_snapshots must be a non-negative integer, got {snapshots!r}"
            )
        check_attention_backend(self.attention_backend)
        check_lora_dtype(self.lora_dtype)
        try:
            size = parse_byte_size(self.prompt_cache_size)
        except ValueError as error:
            raise QinferError(f"engine argument prompt_cache_size {error}") from None
        object.__setattr__(self, "prompt_cache_size", size)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise QinferError(
                f"engine argument gpu_memory_utilization must be in (0, 1], "
                f"got {self.gpu_memory_utilization!r}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise QinferError(
                f"engine argument max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f"at least max_num_seqs ({self.max_num_seqs}): every running sequence needs a token"
            )

    @property
    def num_speculative_tokens(self) -> int:
        """The most tokens proposed per sequence and step (0 without speculative decoding)."""
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    @property
    def runtime(self) -> RuntimeConfig:
        """What the runner and the executor are told (`qinfer.runtime.config`): the
        settings of the same names, and what speculation asks of the pool."""
        shared = {name: getattr(self, name) for name in SHARED}
        drafted = self.speculative is not None and self.speculative.method == "draft"
        return RuntimeConfig(
            **shared,
            num_speculative_tokens=self.num_speculative_tokens,
            whole_space_0=drafted,
            state_snapshots=self.state_snapshots if self.enable_prefix_caching else 0,
        )

    def for_model(self, config: ModelConfig) -> EngineConfig:
        """This config as the engine runs a model of `config`. A hybrid model (Gated
        DeltaNet layers: a recurrent state per sequence, `qinfer.attention.state_pool`)
        needs what is not built yet for some settings: static decode and CUDA graphs would
        need a state slot per padding row; each is switched off with one logged line. (Its
        prefix cache keeps state snapshots beside the blocks, `engine.block_manager`;
        speculative decoding rolls the state back, `attention.state_pool`.)"""
        if config.deltanet is None:
            return self
        off = ["static_decode"] if self.static_decode else []
        off += ["cuda_graphs"] if self.cuda_graphs else []
        for name in off:
            log.warning(
                "%s is off: model_type %r keeps a recurrent state (Gated DeltaNet) per "
                "sequence, which %s does not handle yet",
                name,
                config.model_type,
                name,
            )
        return replace(self, static_decode=False, cuda_graphs=False)

    @classmethod
    def from_kwargs(cls, **engine_args) -> EngineConfig:
        """An EngineConfig from keyword arguments, naming any unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise QinferError(
                f"unknown engine argument {unknown[0]!r}; known: {', '.join(sorted(known))}"
            )
        return cls(**engine_args)


#: The settings EngineConfig passes on to RuntimeConfig as they are.
SHARED = (
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory",
    "gpu_memory_utilization",
    "num_kv_blocks",
    "attention_backend",
    "static_decode",
    "cuda_graphs",
)
