"""Filling a built model: from a checkpoint (`load`) or with random weights (`init_random`).

Both walk the model's modules (`weights/slots.py`): each `Placed` module first takes on
this rank's part, the dtype and the device; then every `LinearSlot` / `GroupedSlot` is
replaced by the Linear its source gives, and every `TensorSlot` is filled in place. A slot
held in two places (a tied lm_head is the embedding's slot) is filled once and replaced in
both. The walk works on any module: a whole `Transformer`, or one layer built on its own.

Peak memory: slots are filled one at a time and each read is freed as its Linear is built,
so a load holds the loaded weights plus one projection's temporary buffers, as a
constructor that read its weights did.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from qinfer.core.errors import QinferError
from qinfer.core.features import Features
from qinfer.core.parallel import SINGLE, Parallel
from qinfer.linear import DenseLinear, Linear, RowParallelLinear
from qinfer.linear.choose import choose_paths
from qinfer.linear.grouped import GroupedLinear, make_grouped_linear
from qinfer.weights.base import Quantize, Weights
from qinfer.weights.slots import GroupedSlot, LinearSlot, LinearSource, Placed, TensorSlot

#: The standard deviation of random weights (transformers' `initializer_range`); random
#: biases and norm scales are drawn around their fresh values with the same spread.
RANDOM_STD = 0.02


def load(
    model: nn.Module,
    checkpoint: Weights,
    parallel: Parallel | None = None,
    quantize: Quantize | None = None,
    features: Features | None = None,
) -> nn.Module:
    """Fill a built `model` from `checkpoint` (in its dtype, on its device); returns model.

    parallel: this process's rank in a tensor-parallel group (default: one process); only
        the rank's part of each projection is read, and a world size that does not split
        the model evenly is refused before anything is read.
    quantize: weight-only quantization of the dense weights (None: they stay dense; a
        GGUF reader's kept blocks stay as they are).
    Quantized Linears on CPU then take the paths of `qinfer.linear.choose.choose_paths`'s
    rule (nothing is timed), for `features` (batch_invariant, exact): by default the
    model's own; a part loaded beside a model (a projector's vision tower) passes that
    model's, so that its kept blocks compute as the model's do.
    """
    parallel = parallel or SINGLE
    _place(model, parallel, checkpoint.dtype, checkpoint.device)

    def read(source: LinearSource) -> Linear:
        if source.dense:  # whole and exact on every rank
            return DenseLinear(checkpoint.tensor(f"{source.names[0]}.weight", source.shapes[0]))
        linear = checkpoint.linear(
            source.names,
            source.shapes,
            source.bias,
            rows=source.rows,
            shard=source.shard(parallel),
            quantize=quantize,
        )
        if not source.reduced and isinstance(linear, RowParallelLinear):
            return linear.local  # partial sums, added up by the layer
        return linear

    def fill(norm: TensorSlot) -> None:
        norm.fill(checkpoint.tensor(norm.source, norm.shape))

    _fill(model, read, fill, "loading weights")
    # each quantized Linear's decode and prefill path, by rule
    features = features or getattr(model, "features", None)
    choose_paths(
        model,
        same_at_any_rows=features is not None and features.batch_invariant,
        exact=features is not None and features.exact,
    )
    return model


def init_random(
    model: nn.Module,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Fill a built `model` with random dense weights (one process); returns model.

    Weights and biases ~ N(0, RANDOM_STD^2); a norm's scale is its fresh value plus the same
    noise. Drawn in fp32 from a generator seeded with `seed`, in the walk's order, then
    cast: the same seed and model give the same weights on any device and dtype.
    """
    device = torch.device(device)
    _place(model, SINGLE, dtype, device)
    generator = torch.Generator().manual_seed(seed)

    def draw(shape: tuple[int, ...], mean: float = 0.0) -> torch.Tensor:
        values = torch.randn(shape, generator=generator) * RANDOM_STD + mean
        return values.to(device, dtype)

    def read(source: LinearSource) -> Linear:
        bias = draw((source.out_features,)) if source.bias else None
        return DenseLinear(draw((source.out_features, source.in_features)), bias)

    def fill(norm: TensorSlot) -> None:
        norm.fill(draw(norm.shape, norm.initial))

    _fill(model, read, fill, "drawing weights")
    return model


def quantizable_weights(model: nn.Module) -> set[str]:
    """The checkpoint names (`prefix.weight`) of every weight `load` reads as a Linear that
    keeps a quantized kind where the checkpoint has one: each slot's sources, but the
    `dense` ones (a router, read dense by `checkpoint.tensor`). What else the checkpoint holds
    (norms, a conv kernel, decays: `TensorSlot`s) is never multiplied as a Linear."""
    names = set()
    for module in model.modules():
        if isinstance(module, LinearSlot | GroupedSlot):
            sources = module.sources if isinstance(module, GroupedSlot) else [module.source]
            names |= {f"{n}.weight" for s in sources if not s.dense for n in s.names}
    return names


def _place(model: nn.Module, parallel: Parallel, dtype: torch.dtype, device: torch.device) -> None:
    """Every `Placed` module takes on its rank's part, dtype and device (parents first)."""
    for module in model.modules():
        if isinstance(module, Placed):
            module.place(parallel, dtype, device)


def _fill(
    model: nn.Module,
    read: Callable[[LinearSource], Linear],
    fill: Callable[[TensorSlot], None],
    what: str,
) -> None:
    """Replace every slot of `model` with `read(source)`'s Linear (a grouped slot: one per
    group, grouped), wherever the model holds it, and `fill` every TensorSlot."""
    if isinstance(model, LinearSlot | GroupedSlot):
        raise QinferError("load a module that holds slots, not a slot itself")
    owners: dict[nn.Module, list[tuple[nn.Module, str]]] = defaultdict(list)
    tensors: list[TensorSlot] = []
    for parent in model.modules():
        if isinstance(parent, TensorSlot) and parent.source is not None:
            tensors.append(parent)
        for name, child in parent._modules.items():  # every name, a tied head's included
            if isinstance(child, LinearSlot | GroupedSlot):
                owners[child].append((parent, name))
    for norm in tensors:
        fill(norm)
    for slot, places in tqdm(owners.items(), desc=what, leave=False, disable=None):
        linear: Linear | GroupedLinear
        if isinstance(slot, GroupedSlot):
            linear = make_grouped_linear([read(source) for source in slot.sources])
        else:
            linear = read(slot.source)
            # which checkpoint projections it holds, side by side: what a LoRA adapter
            # names (`qinfer.lora.adapters`)
            linear.source = slot.source
        for parent, name in places:
            setattr(parent, name, linear)
