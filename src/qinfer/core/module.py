"""The base of every qinfer layer and Linear: a `torch.nn.Module` that is cheap to read in a
decode step.

`nn.Module` keeps submodules and buffers in dicts of its own and finds them through
`__getattr__`, which Python calls only after the ordinary lookup fails: some twenty times
an instance attribute's cost, and a decode step of SmolLM2 (30 layers) reads about 700 of
them (each block's norms and projections, each projection's tensors; figures:
docs/BENCHMARKS.md, "Module attribute reads"). Here each submodule and buffer is also mirrored in the instance dict, so a read is
an ordinary lookup; `nn.Module` still owns them (`named_modules`, `state_dict`, hooks,
`.to()`), and every way it sets, moves or deletes one updates the mirror.

What remains is `nn.Module.__call__`: two frames of its own and, before `forward`, checks
of the module's four hook dicts, of the global ones, of `torch.compile` and of tracing,
about 270 calls a SmolLM2 decode step. Reading an nn.Module's attributes stays slower
than a plain object's even when mirrored (`nn.Module.__getattr__` keeps CPython 3.11 from
specializing the read), and between two decode steps the CPU's caches hold the model's
data, not the interpreter's: the module checks alone cost a few percent of a SmolLM2
batch-1 decode step (docs/BENCHMARKS.md, "Module attribute reads"). So `Module.__call__` reads one flag instead, set for good once
any qinfer module takes a hook or is compiled (a removed hook is not noticed: the calls
stay on the full path, which costs speed, never a hook), and the four global hook dicts
(a profiler's or a debugger's hooks); while none is set it calls `forward` directly,
otherwise it hands over to `nn.Module.__call__`, so hooks fire as before. `torch.jit.trace`
records the ops of the fast path without the modules' scopes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

# The global hook registries `nn.Module.__call__` checks (dicts changed in place, so these
# names stay bound to the live ones).
_FORWARD_PRE_HOOKS = _nn_module._global_forward_pre_hooks
_FORWARD_HOOKS = _nn_module._global_forward_hooks
_BACKWARD_PRE_HOOKS = _nn_module._global_backward_pre_hooks
_BACKWARD_HOOKS = _nn_module._global_backward_hooks

#: Whether any qinfer module has taken a hook or been compiled (see the module docstring).
_hooked = False


class Module(nn.Module):
    """`nn.Module` with its submodules and buffers mirrored as instance attributes, and a
    call that goes straight to `forward` while no hook is set."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (
            _hooked
            or _FORWARD_PRE_HOOKS
            or _FORWARD_HOOKS
            or _BACKWARD_PRE_HOOKS
            or _BACKWARD_HOOKS
        ):
            return nn.Module.__call__(self, *args, **kwargs)
        return self.forward(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)  # drops the mirror of a name it re-registers
        self._mirror(name)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        self.__dict__.pop(name, None)

    def register_buffer(
        self, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        super().register_buffer(name, tensor, persistent)
        self._mirror(name)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        super().add_module(name, module)
        self._mirror(name)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Module:
        super()._apply(fn, recurse)  # replaces the buffers (`.to()`, `.half()`, ...)
        for name in self._buffers:
            self._mirror(name)
        return self

    def _mirror(self, name: str) -> None:
        for registry in (self._modules, self._buffers):
            if name in registry:
                self.__dict__[name] = registry[name]
                return


def _noting_hooks(register: Callable[..., Any]) -> Callable[..., Any]:
    """nn.Module's `register`, which also sets `_hooked`: calls take the full path from now."""

    @functools.wraps(register)
    def noted(self: Module, *args: Any, **kwargs: Any) -> Any:
        global _hooked
        _hooked = True
        return register(self, *args, **kwargs)

    return noted


for _name in (
    "register_forward_pre_hook",
    "register_forward_hook",
    "register_backward_hook",
    "register_full_backward_pre_hook",
    "register_full_backward_hook",
    "compile",  # sets `_compiled_call_impl`, which only nn.Module.__call__ runs
):
    setattr(Module, _name, _noting_hooks(getattr(nn.Module, _name)))
