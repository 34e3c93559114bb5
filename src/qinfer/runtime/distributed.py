"""Starting a tensor-parallel group: N processes, one per rank, joined by `torch.distributed`.

Two ways in, one result (a `TensorParallelGroup` on rank 0):

- Under `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set), every
  process runs the same command: rank 0 goes on to serve; every other rank runs `worker`
  (load its shard, follow rank 0's steps) and then exits. Several machines work the same
  way (`torchrun --nnodes M --nproc-per-node K`).
- Otherwise this process is rank 0 and spawns the N - 1 workers on this machine
  (torch.multiprocessing, 'spawn'), meeting them on a free loopback port.

The model's collectives use gloo on CPU and NCCL on CUDA (rank r on cuda:LOCAL_RANK), with
a timeout: a lost peer fails a collective, it never hangs. Rank 0's step messages travel
on a second, CPU (gloo) group, `control`, whose timeout is long: workers wait there, idle,
for as long as rank 0 serves, and a rank 0 that dies closes its sockets, which ends them.

Faults: a rank that fails to load makes every rank raise one line naming it and why
(`load_on_every_rank`); a spawned worker that dies is named by `failure`, which rank 0
calls when a collective fails, and by `watch`, which tells a server whose rank 0 is idle;
Ctrl-C reaches every process of the terminal, and spawned workers are daemons, ended when
rank 0 exits.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qinfer.core.errors import QinferError
from qinfer.core.parallel import Parallel

#: How long a collective of the model (and joining the group) may wait for a peer.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
#: How long a worker waits for rank 0's next step: as long as rank 0 lives.
IDLE_TIMEOUT = datetime.timedelta(days=365)
#: How long rank 0, after a failed collective, waits for a worker's exit to name it.
EXIT_GRACE_S = 5.0

T = TypeVar("T")


class TensorParallelError(QinferError):
    """A rank failed or died: the group cannot go on."""


@dataclass
class TensorParallelGroup:
    """This process's place in a running tensor-parallel group.

    parallel: rank, world size (the model's collectives use the default group).
    device: this rank's device (cuda:LOCAL_RANK on GPU).
    control: the CPU (gloo) group rank 0's step messages travel on.
    workers: the processes rank 0 spawned (ranks 1..N-1, in order); empty on a worker and
        under torchrun, where torchrun watches the processes.
    """

    parallel: Parallel
    device: torch.device
    control: dist.ProcessGroup
    workers: list[BaseProcess] = field(default_factory=list)
    closing: bool = field(default=False, init=False)  # workers exiting now is no fault

    def failure(self, error: BaseException) -> TensorParallelError:
        """The one-line error for a failed collective: the worker that died, if one did
        (waiting up to EXIT_GRACE_S for it to be gone), else the collective's own message."""
        for process in self.workers:
            process.join(EXIT_GRACE_S / len(self.workers))
            if process.exitcode is not None:
                return self._died(process)
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return TensorParallelError(f"tensor-parallel collective failed: {first_line}")

    def watch(self, on_death: Callable[[TensorParallelError], None]) -> None:
        """Call on_death (from a daemon thread) when a spawned worker exits before `close`,
        so that rank 0 learns of it even while it runs no step."""

        def wait_for_an_exit() -> None:
            by_sentinel = {process.sentinel: process for process in self.workers}
            dead = by_sentinel[wait(list(by_sentinel))[0]]
            dead.join()  # its sentinel is ready: it has exited; join reads its exit code
            if not self.closing:
                on_death(self._died(dead))

        threading.Thread(target=wait_for_an_exit, name="qinfer-tp-watch", daemon=True).start()

    def close(self) -> None:
        """Leave the group; rank 0 then waits for its workers (they stop on their own once
        told to, see `engine.step_channel`) and ends any that do not."""
        self.closing = True
        if dist.is_initialized():
            dist.destroy_process_group()
        for process in self.workers:
            process.join(EXIT_GRACE_S)
            if process.is_alive():
                process.terminate()

    def _died(self, process: BaseProcess) -> TensorParallelError:
        """'tensor-parallel rank 1 died (killed by SIGKILL)' for an exited worker."""
        rank = self.workers.index(process) + 1
        code = process.exitcode
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return TensorParallelError(f"tensor-parallel rank {rank} died ({why})")


def init_tensor_parallel(
    size: int,
    device: str | torch.device | None,
    worker: Callable[[TensorParallelGroup], None],
) -> TensorParallelGroup:
    """Join (under torchrun) or start (spawning size - 1 workers) a group of `size` ranks;
    returns rank 0's place in it. `worker` runs on every other rank and must be picklable
    (a module-level function or a `functools.partial` of one); under torchrun a worker
    rank never returns from this call: it exits once `worker` returns."""
    if size < 2:
        raise QinferError(f"a tensor-parallel group needs at least 2 ranks, got {size}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise QinferError(f"tensor parallel size is {size} but torchrun started {world} ranks")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        group = _join(rank, size, local_rank, local_size, device, "env://")
        if rank != 0:
            _run_worker(group, worker)
            sys.exit(0)
        return group
    port = _free_port()
    context = mp.get_context("spawn")
    workers = [
        context.Process(
            target=_spawned_worker,
            args=(rank, size, port, device, worker),
            name=f"qinfer-rank-{rank}",
            daemon=True,  # ended when rank 0 exits, however it exits
        )
        for rank in range(1, size)
    ]
    for process in workers:
        process.start()
    group = _join(0, size, 0, size, device, f"tcp://127.0.0.1:{port}")
    group.workers = workers
    return group


def load_on_every_rank(group: TensorParallelGroup, load: Callable[[], T]) -> T:
    """`load()` on every rank, then compare notes: if any rank failed, every rank raises
    one QinferError, its own message if it failed itself, else naming the first rank that
    did ('tensor-parallel rank 1 failed to load: ...')."""
    try:
        result, error = load(), None
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised
        result, error = None, exc
    message = None if error is None else (str(error) or type(error).__name__)
    messages: list[str | None] = [None] * group.parallel.world_size
    dist.all_gather_object(messages, message, group=group.control)
    if error is not None:
        raise error
    for rank, failed in enumerate(messages):
        if failed is not None:
            raise TensorParallelError(f"tensor-parallel rank {rank} failed to load: {failed}")
    return result  # type: ignore[return-value]


def _join(
    rank: int,
    size: int,
    local_rank: int,
    local_size: int,
    device: str | torch.device | None,
    init_method: str,
) -> TensorParallelGroup:
    """init_process_group (NCCL on CUDA, gloo on CPU) and the gloo control group; local_rank
    of the local_size ranks on this machine picks the GPU (or shares the CPU cores)."""
    from qinfer.model.loading import default_device

    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        # The ranks on this machine share its cores.
        torch.set_num_threads(max(1, torch.get_num_threads() // local_size))
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TensorParallelGroup(Parallel(rank, size), device, control)


def _spawned_worker(
    rank: int,
    size: int,
    port: int,
    device: str | torch.device | None,
    worker: Callable[[TensorParallelGroup], None],
) -> None:
    """A spawned rank: join the group on the loopback port, run `worker`, leave."""
    try:
        _run_worker(_join(rank, size, rank, size, device, f"tcp://127.0.0.1:{port}"), worker)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank; rank 0 reports it
        sys.exit(130)


def _run_worker(group: TensorParallelGroup, worker: Callable[[TensorParallelGroup], None]) -> None:
    """Run `worker` on this rank. A QinferError (a failed load: rank 0 has gathered it and
    reports it) exits with status 1 quietly; a collective's RuntimeError (rank 0 is gone)
    prints one line first."""
    try:
        worker(group)
    except QinferError:
        sys.exit(1)
    except RuntimeError as error:
        first_line = (str(error).strip().splitlines() or ["RuntimeError"])[0]
        print(f"qinfer: tensor-parallel rank {group.parallel.rank}: {first_line}", file=sys.stderr)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
