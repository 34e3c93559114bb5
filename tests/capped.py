"""A kernel call in a fresh process whose automatic paths are capped by ATEN_CPU_CAPABILITY,
or whose AMX tiles run on the kernels' software model (QINFER_AMX=emulate): both are read
once a process, so a test compares that process's bits with this one's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


def in_capped_process(capability: str, folder: Path, call: str, *inputs: object) -> object:
    """`call`, an expression over `inputs` (with torch and qinfer.kernels imported), evaluated
    in a fresh process under ATEN_CPU_CAPABILITY=capability; its result, through files in
    `folder`."""
    return in_fresh_process({"ATEN_CPU_CAPABILITY": capability}, folder, call, *inputs)


def in_fresh_process(env: dict[str, str], folder: Path, call: str, *inputs: object) -> object:
    """`call` as `in_capped_process` evaluates it, in a fresh process with `env` added to this
    one's environment."""
    torch.save(inputs, folder / "in.pt")
    script = (
        "import sys, torch; from qinfer import kernels; "
        "inputs = torch.load(sys.argv[1]); "
        f"torch.save({call}, sys.argv[2])"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(folder / "in.pt"), str(folder / "out.pt")],
        env={**os.environ, **env},
        check=True,
    )
    return torch.load(folder / "out.pt")
