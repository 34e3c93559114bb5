"""A kernel call in a fresh process whose automatic paths are capped by ATEN_CPU_CAPABILITY
(read once a process, so a test compares a capped path's bits with this process's there)."""

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
    torch.save(inputs, folder / "in.pt")
    script = (
        "import sys, torch; from qinfer import kernels; "
        "inputs = torch.load(sys.argv[1]); "
        f"torch.save({call}, sys.argv[2])"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(folder / "in.pt"), str(folder / "out.pt")],
        env={**os.environ, "ATEN_CPU_CAPABILITY": capability},
        check=True,
    )
    return torch.load(folder / "out.pt")
