"""An adapter file's tensors paired by projection, checked and scaled: what a PEFT folder
(`qinfer.lora.adapter`) and a llama.cpp GGUF adapter (`qinfer.lora.gguf_adapter`) share."""

from __future__ import annotations

from collections.abc import Callable

import torch

from qinfer.core.errors import AdapterError


def scaled_pairs(
    where: str,
    pairs: dict[str, dict[str, torch.Tensor]],
    halves: tuple[str, str],
    scale: Callable[[int], float],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """pairs: projection -> {"A": (r, in), "B": (out, r)} as read from `where`, halves: the
    file's names of A and B (for its errors), scale(r): a pair's scale -> projection ->
    (A, B * scale), or one error naming the projection (a half missing, shapes that do
    not pair) or the file (no pair at all)."""
    if not pairs:
        raise AdapterError(f"{where}: holds no LoRA tensors")
    modules = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            missing = halves[0] if "A" not in ab else halves[1]
            raise AdapterError(f"{where}: {module} has no {missing} tensor")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise AdapterError(
                f"{where}: {module}'s {halves[0]} {tuple(a.shape)} and {halves[1]} "
                f"{tuple(b.shape)} are not (r, in) and (out, r)"
            )
        modules[module] = (a, b * scale(a.shape[0]))
    return modules
