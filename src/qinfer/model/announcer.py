"""What a command says while it loads a model: at once, that it is loading (on a terminal),
then one line saying what was loaded, how and how fast (always, on stderr).

    qinfer: loaded SmolLM2-135M-Instruct.Q4_1 (GGUF, int4+int8 weights, 94 MB) as bfloat16
    on cpu, 2 threads, in 7.3 s

stdout stays the model's text alone, so `qinfer generate ... > out.txt` holds only that;
the line goes to stderr even when it is not a terminal, so a log says what ran. On a
terminal the notice is replaced by the line once the model is loaded (the layer bar
that `load_model` draws in between clears itself).

Nothing here imports torch: the notice must come before that second of imports.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qinfer.model.transformer import Transformer

#: Short names of the Linear classes (less their "Linear" suffix).
_KIND_NAMES = {"Int4": "int4", "Int8": "int8", "Dense": "dense", "StackedDense": "dense"}

#: Cursor up one line, back to its start, clear it (ANSI; only ever sent to a terminal).
_OVERWRITE_PREVIOUS_LINE = "\x1b[1A\r\x1b[2K"


def display_name(spec: str | None, path: Path) -> str:
    """What the user knows the model as: a hub id as typed, else the file's or folder's name."""
    if spec is not None and not Path(spec).expanduser().exists():
        return spec  # a hub id: its local path is a snapshot hash
    return path.stem if path.suffix == ".gguf" else path.name


class LoadAnnouncer:
    """Announce one model load: `started()` before it, `finished(model)` after."""

    def __init__(self, name: str, path: Path, out=None) -> None:
        self.name, self.path = name, path
        self.out = out if out is not None else sys.stderr
        self.on_terminal = self.out.isatty()
        self.start = time.perf_counter()

    def started(self) -> None:
        """The notice, on a terminal only (a log gets the one line of `finished`)."""
        self.start = time.perf_counter()
        if self.on_terminal:
            print(f"qinfer: loading {self.name} ...", file=self.out, flush=True)

    def finished(self, model: Transformer) -> str:
        """Print the start-up line (over the notice on a terminal) and return it."""
        line = loaded_line(self.name, self.path, model, time.perf_counter() - self.start)
        prefix = _OVERWRITE_PREVIOUS_LINE if self.on_terminal else ""
        print(prefix + line, file=self.out, flush=True)
        return line


def loaded_line(name: str, path: Path, model: Transformer, seconds: float) -> str:
    """`qinfer: loaded NAME (FORMAT, KINDS weights, SIZE) as DTYPE on DEVICE, N threads,
    in S s`."""
    import torch

    kinds = weight_kinds(model)
    size = sum(kinds.values())
    stored = "GGUF" if path.suffix == ".gguf" else "safetensors"
    kind_names = "+".join(sorted(kinds, key=lambda kind: -kinds[kind]))
    dtype = str(model.dtype).removeprefix("torch.")
    threads = torch.get_num_threads()
    return (
        f"qinfer: loaded {name} ({stored}, {kind_names} weights, {_size(size)}) "
        f"as {dtype} on {model.device}, {threads} thread{'s' * (threads != 1)}, "
        f"in {seconds:.1f} s"
    )


def _size(nbytes: int) -> str:
    """95 MB, 1.2 GB; 0.3 MB for a test's tiny model."""
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.1f} GB"
    return f"{nbytes / 1e6:.0f} MB" if nbytes >= 1e7 else f"{nbytes / 1e6:.1f} MB"


def weight_kinds(model: Transformer) -> Counter[str]:
    """Bytes of the model's projections by kind: "int4", "int8", "dense" (or another
    Linear's class name), looking inside fused and tensor-parallel wrappers."""
    found: Counter[str] = Counter()
    pending = list(model.linears().values())
    while pending:
        linear = pending.pop()
        inner = getattr(linear, "parts", None) or [getattr(linear, "local", None)]
        if inner != [None]:  # a ConcatLinear's parts, a parallel Linear's local part
            pending.extend(inner)
            continue
        kind = type(linear).__name__.removesuffix("Linear")
        found[_KIND_NAMES.get(kind, kind)] += linear.nbytes
    return found
