"""The LoRA adapters resident on one loaded model, by name, each in a slot that a step's
rows name (`qinfer.core.forward_batch.AdapterRows`).

Loading one puts its A/B pairs beside the projections it targets: the first adapter turns
a projection into a `qinfer.linear.lora.LoraLinear` around the same base Linear; a model
that never loads one runs exactly as before. PEFT names the checkpoint's projections
(`model.layers.0.self_attn.q_proj`); qinfer fuses q/k/v and gate/up, so each part's pair
lands at the fused projection's rows of that part (`LinearSource.names` and shapes, kept by
the loader). Attention's q/k/v/o and the dense MLP's gate/up/down take adapters; experts,
routers and linear-attention projections are refused, as is tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qinfer.core.errors import AdapterError
from qinfer.layers.attention import Attention
from qinfer.layers.mlp import MLP
from qinfer.linear import Linear
from qinfer.linear.lora import LoraLinear
from qinfer.lora.adapter import LoraAdapter, read_adapter


@dataclass(frozen=True)
class Target:
    """Where a checkpoint projection lives in the model: `owner.attr` is the (fused)
    Linear, rows offset .. offset + out of its output are this projection's."""

    owner: nn.Module
    attr: str
    offset: int
    out: int
    inputs: int


@dataclass(frozen=True)
class Resident:
    """A loaded adapter: its slot, the id the prefix cache keys its blocks with (never
    reused: a name loaded again is another adapter), where it came from, its rank."""

    slot: int
    key: int
    path: str
    rank: int


class Adapters:
    """The adapters of `model`, at most max_loras at once, each of rank <= max_lora_rank."""

    def __init__(self, model: nn.Module, max_loras: int = 4, max_lora_rank: int = 64) -> None:
        if model.parallel.world_size > 1:
            raise AdapterError("LoRA adapters are not supported under tensor parallelism")
        if max_loras < 1 or max_lora_rank < 1:
            raise AdapterError(
                f"max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) must be >= 1"
            )
        self.model, self.max_loras, self.max_lora_rank = model, max_loras, max_lora_rank
        self.targets = _targets(model)
        self.resident: dict[str, Resident] = {}
        self._keys = 0

    def __contains__(self, name: str) -> bool:
        return name in self.resident

    def names(self) -> list[str]:
        return list(self.resident)

    def get(self, name: str) -> Resident:
        """The loaded adapter `name`; an unknown name refused in one line."""
        found = self.resident.get(name)
        if found is None:
            loaded = ", ".join(self.resident) or "none"
            raise AdapterError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        return found

    def load(self, name: str, source: str | Path | LoraAdapter) -> Resident:
        """Read the adapter at `source` (a path, or one read already) and place it under
        `name`: checked whole against the model before any projection takes it."""
        if not name:
            raise AdapterError("lora_name must not be empty")
        if name in self.resident:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded")
        if len(self.resident) >= self.max_loras:
            raise AdapterError(
                f"cannot load LoRA adapter {name!r}: max_loras={self.max_loras} adapters are "
                "loaded; unload one first"
            )
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
        used = {resident.slot for resident in self.resident.values()}
        slot = min(set(range(self.max_loras)) - used)
        for (owner, attr), (a, b) in placed.items():
            projection = getattr(owner, attr)
            if not isinstance(projection, LoraLinear):
                projection = LoraLinear(projection, self.model.features.batch_invariant)
                setattr(owner, attr, projection)
            projection.add(slot, a, b)
        self._keys += 1
        resident = Resident(slot, self._keys, adapter.path, adapter.rank)
        self.resident[name] = resident
        return resident

    def unload(self, name: str) -> None:
        """Drop adapter `name` from every projection (its slot free for the next)."""
        slot = self.get(name).slot
        for module in self.model.modules():
            if isinstance(module, LoraLinear):
                module.remove(slot)
        del self.resident[name]

    def _placed(
        self, name: str, adapter: LoraAdapter
    ) -> dict[tuple[nn.Module, str], tuple[torch.Tensor, torch.Tensor]]:
        """Each targeted (fused) projection's pair: the parts' A stacked (sum r, in) and
        their B block-diagonal (out, sum r), in the model's dtype on its device."""
        parts: dict[tuple[nn.Module, str], list[tuple[Target, torch.Tensor, torch.Tensor]]] = {}
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
            parts.setdefault((target.owner, target.attr), []).append((target, a, b))
        placed = {}
        dtype, device = adapter_dtype(self.model.dtype, self.model.device), self.model.device
        for (owner, attr), found in parts.items():
            rank = sum(a.shape[0] for _, a, _ in found)
            stacked_b = torch.zeros(getattr(owner, attr).out_features, rank)
            column = 0
            for target, a, b in found:
                rows = slice(target.offset, target.offset + target.out)
                stacked_b[rows, column : column + a.shape[0]] = b
                column += a.shape[0]
            stacked_a = torch.cat([a for _, a, _ in found])
            placed[owner, attr] = (stacked_a.to(device, dtype), stacked_b.to(device, dtype))
        return placed


def adapter_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype adapters compute in: the model's, but fp32 on the CPU, whose GEMMs of a
    LoRA's thin shapes ((n, in) x (in, r), r ~ 16) run several times faster in fp32 than
    in bf16 (docs/BENCHMARKS.md, "LoRA adapters at decode")."""
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
            offset = 0
            for name, (out, inputs) in zip(linear.source.names, linear.source.shapes, strict=True):
                targets[name] = Target(owner, attr, offset, out, inputs)
                offset += out
    return targets
