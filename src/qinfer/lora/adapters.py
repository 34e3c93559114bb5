"""The LoRA adapters loaded on one model, by name, and those of them resident in the
model's projections, each in a slot that a step's rows name
(`qinfer.core.forward_batch.AdapterRows`).

Loaded and resident, as vLLM's --max-cpu-loras and --max-loras: every loaded adapter stays
in host memory as read (fp32) until it is unloaded (no bound: vLLM's max_cpu_loras has no
counterpart); at most max_loras are resident, placed in the projections' slots where rows
can run through them. A request admitted (or a load) that needs an adapter made resident
past the bound evicts the least recently used resident adapter that no unfinished request
runs through (its pairs leave the projections; it stays loaded, and its prefix-cache key
with it). When every resident adapter is in use, a request waits in the scheduler's queue
until a slot frees (as vLLM's does), and a load is refused in one line
(`AdapterSlotsBusyError`, a server's 503).

Making one resident puts its A/B pairs beside the projections it targets: the first adapter
turns a projection into a `qinfer.linear.lora.LoraLinear` around the same base Linear; a
model that never loads one runs exactly as before. PEFT names the checkpoint's projections
(`model.layers.0.self_attn.q_proj`); qinfer fuses q/k/v and gate/up, so a pair lands on
its part of the fused projection, its rows of the output (`LinearSource.names` and
shapes, kept by the loader). Attention's q/k/v/o and the dense MLP's gate/up/down take adapters; experts,
routers and linear-attention projections are refused, as is tensor parallelism.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qinfer.core.errors import AdapterError, AdapterSlotsBusyError
from qinfer.core.features import check_lora_dtype
from qinfer.layers.attention import Attention
from qinfer.layers.mlp import MLP
from qinfer.linear import Linear
from qinfer.linear.lora import LoraLinear, Pairs
from qinfer.lora.adapter import LoraAdapter, read_adapter


@dataclass(frozen=True)
class Target:
    """Where a checkpoint projection lives in the model: `owner.attr` is the (fused)
    Linear, whose outputs are `parts` (each part's rows, in order); this projection is part
    `part`, out x inputs."""

    owner: nn.Module
    attr: str
    part: int
    parts: tuple[int, ...]
    out: int
    inputs: int


#: A resident adapter's pairs: each (fused) projection (owner, attr) -> its parts' pairs
#: (`qinfer.linear.lora.Pairs`), in the adapters' dtype on the model's device.
Placed = dict[tuple[nn.Module, str], Pairs]


@dataclass(frozen=True)
class Loaded:
    """A loaded adapter: its name, the id the prefix cache keys its blocks with (never
    reused: a name loaded again is another adapter), where it came from, its rank."""

    name: str
    key: int
    path: str
    rank: int


class Adapters:
    """The adapters of `model`: any number loaded, at most max_loras resident, each of rank
    <= max_lora_rank, held in `lora_dtype` (`qinfer.core.features.LORA_DTYPES`, `adapter_dtype`)."""

    def __init__(
        self,
        model: nn.Module,
        max_loras: int = 4,
        max_lora_rank: int = 64,
        lora_dtype: str = "auto",
    ) -> None:
        if model.parallel.world_size > 1:
            raise AdapterError("LoRA adapters are not supported under tensor parallelism")
        if max_loras < 1 or max_lora_rank < 1:
            raise AdapterError(
                f"max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) must be >= 1"
            )
        check_lora_dtype(lora_dtype)
        self.model, self.max_loras, self.max_lora_rank = model, max_loras, max_lora_rank
        self.dtype = adapter_dtype(model.dtype, model.device, lora_dtype)
        self.targets = _targets(model)
        self.loaded: dict[str, tuple[Loaded, LoraAdapter]] = {}
        # name -> slot, least recently used first
        self.resident: OrderedDict[str, int] = OrderedDict()
        self._keys = 0

    def __contains__(self, name: str) -> bool:
        return name in self.loaded

    def names(self) -> list[str]:
        return list(self.loaded)

    def get(self, name: str) -> Loaded:
        """The loaded adapter `name`; an unknown name refused in one line."""
        found = self.loaded.get(name)
        if found is None:
            loaded = ", ".join(self.loaded) or "none"
            raise AdapterError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        return found[0]

    def load(
        self, name: str, source: str | Path | LoraAdapter, in_use: Collection[int] = ()
    ) -> Loaded:
        """Read the adapter at `source` (a path, or one read already), check it whole
        against the model and make it resident under `name` (evicting as `acquire` does;
        in_use: the slots unfinished requests run through). Nothing changes on a refusal."""
        if not name:
            raise AdapterError("lora_name must not be empty")
        if name in self.loaded:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded")
        adapter = (
            source
            if isinstance(source, LoraAdapter)
            else read_adapter(source, self.model.config.head_dim)
        )
        if adapter.rank > self.max_lora_rank:
            raise AdapterError(
                f"LoRA adapter {name!r}: rank {adapter.rank} is above max_lora_rank "
                f"{self.max_lora_rank}"
            )
        placed = self._placed(name, adapter)
        slot = self._free_slot(name, in_use)
        self._keys += 1
        loaded = Loaded(name, self._keys, adapter.path, adapter.rank)
        self.loaded[name] = (loaded, adapter)
        self._place(name, slot, placed)
        return loaded

    def acquire(self, loaded: Loaded, in_use: Collection[int]) -> int:
        """The slot `loaded` runs in, made resident if it is not (the least recently used
        resident adapter whose slot is not in `in_use` evicted to make room), and marked
        used now. Refused in one line if it was unloaded, or every slot is in use."""
        found = self.loaded.get(loaded.name)
        if found is None or found[0].key != loaded.key:
            raise AdapterError(f"LoRA adapter {loaded.name!r} was unloaded")
        if loaded.name in self.resident:
            self.resident.move_to_end(loaded.name)
            return self.resident[loaded.name]
        placed = self._placed(loaded.name, found[1])
        slot = self._free_slot(loaded.name, in_use)
        self._place(loaded.name, slot, placed)
        return slot

    def unload(self, name: str) -> None:
        """Forget adapter `name`, out of every projection if resident (its slot free)."""
        self.get(name)
        if name in self.resident:
            self._evict(name)
        del self.loaded[name]

    def _free_slot(self, name: str, in_use: Collection[int]) -> int:
        """A slot for `name`: a free one, else the least recently used resident adapter's
        that `in_use` does not hold (that adapter evicted)."""
        used = set(self.resident.values())
        if len(used) < self.max_loras:
            return min(set(range(self.max_loras)) - used)
        victim = next((held for held, slot in self.resident.items() if slot not in in_use), None)
        if victim is None:
            raise AdapterSlotsBusyError(
                f"cannot make LoRA adapter {name!r} resident: all max_loras={self.max_loras} "
                f"resident adapters ({', '.join(self.resident)}) are in use by unfinished requests"
            )
        slot = self.resident[victim]
        self._evict(victim)
        return slot

    def _place(self, name: str, slot: int, placed: Placed) -> None:
        for (owner, attr), pairs in placed.items():
            projection = getattr(owner, attr)
            if not isinstance(projection, LoraLinear):
                parts = tuple(out for out, _ in projection.source.shapes)
                batch_invariant = self.model.features.batch_invariant
                projection = LoraLinear(projection, parts, batch_invariant)
                setattr(owner, attr, projection)
            projection.add(slot, pairs)
        self.resident[name] = slot

    def _evict(self, name: str) -> None:
        slot = self.resident.pop(name)
        for module in self.model.modules():
            if isinstance(module, LoraLinear):
                module.remove(slot)

    def _placed(self, name: str, adapter: LoraAdapter) -> Placed:
        """Each targeted (fused) projection's pairs, one per part it targets."""
        placed: Placed = {}
        dtype, device = self.dtype, self.model.device
        for module, (a, b) in adapter.modules.items():
            target = self.targets.get(module)
            if target is None:
                raise AdapterError(
                    f"LoRA adapter {name!r} targets {module}, which is not an attention "
                    "(q/k/v/o) or dense MLP (gate/up/down) projection of this model"
                )
            if a.shape[1] != target.inputs or b.shape[0] != target.out:
                raise AdapterError(
                    f"LoRA adapter {name!r} ({adapter.path}): {module} is {b.shape[0]} x "
                    f"{a.shape[1]} in the adapter, {target.out} x {target.inputs} in the model "
                    "(another base model?)"
                )
            pairs = placed.setdefault((target.owner, target.attr), [None] * len(target.parts))
            pairs[target.part] = (a.to(device, dtype), b.to(device, dtype))
        return placed


def adapter_dtype(
    dtype: torch.dtype, device: torch.device, lora_dtype: str = "auto"
) -> torch.dtype:
    """The dtype adapters are held in. auto: the model's, but fp32 on the CPU, so that an
    adapter read from fp32 (PEFT's default) or fp16 is never rounded. bfloat16 halves the
    bytes a decode step reads for them, which is most of what they cost there
    (docs/BENCHMARKS.md, "LoRA adapters at decode"), for one rounding of each weight (B
    with its scale folded in); the CPU's op widens it exactly and sums in fp32."""
    if lora_dtype != "auto":
        return getattr(torch, lora_dtype)
    return torch.float32 if device.type == "cpu" else dtype


def _targets(model: nn.Module) -> dict[str, Target]:
    """Every checkpoint projection an adapter may target, by its checkpoint name."""
    targets: dict[str, Target] = {}
    for owner in model.modules():
        if not isinstance(owner, Attention | MLP):
            continue
        for attr, child in owner.named_children():
            linear = child.base if isinstance(child, LoraLinear) else child
            if not isinstance(linear, Linear) or linear.source is None:
                continue
            parts = tuple(out for out, _ in linear.source.shapes)
            for part, (name, (out, inputs)) in enumerate(
                zip(linear.source.names, linear.source.shapes, strict=True)
            ):
                targets[name] = Target(owner, attr, part, parts, out, inputs)
    return targets
