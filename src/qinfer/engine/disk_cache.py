"""The prefix cache's disk tier: full KV blocks of finished prompts kept as files, so that a
restarted engine, or another process on the machine, reads a long prompt's K/V instead of
recomputing them (`--prompt-cache-dir`, `--prompt-cache-size`).

    DIR/<model fingerprint>/<block digest>.kvb      one block (`qinfer.engine.block_file`)
    DIR/<model fingerprint>/<block digest>.kvs      a hybrid model's state after that block

Keys. A block's digest chains over its parent's (blake2b, 128 bits) and its key (the prefix
cache's `Sequence.block_key`: token ids and image digests), from a root that is the model's
fingerprint (`model_fingerprint`: its config, features, dtype, KV format, block size and a
sample of every weight tensor). The prefix cache's in-memory hash is a Python hash, which
is neither stable across processes (bytes are salted) nor wide enough to trust without a
stored key; the digest is both. Models never share a name; another model's folder is
named at start-up (one warning) and never read.

Writing. When a request finishes, the engine hands its full blocks that are not on disk
yet (`save`) to one writer thread: their pool block ids and the pool's allocation counts
(`BlockPool.generation`). The writer copies each block out of the pool and checks that
the block was not reallocated meanwhile (a reused block is dropped, never written), then
writes a temporary file and renames it into place (atomic: a reader sees a whole file or
none). No step waits for it, and no lock is held: several processes may share DIR.

Reading. On an in-memory miss, the block manager asks for the next blocks of the chain
(`read`): a file is used only if its header names this model and this block, and its
payload's length and crc32 hold; otherwise it is removed with one warning (it can never
be right for this model: its name is this model's digest).

States. A hybrid model's prefix cache needs, besides a prefix's K/V, its Gated DeltaNet
state after exactly those tokens (`engine.block_manager`, "State snapshots"). So the
snapshots held in memory for a finished sequence's blocks are written too, each beside its
block, in the same format (the key tagged `STATE_KEY`, so that neither kind of file passes
for the other): every DeltaNet layer's conv window and fp32 matrix, as `StatePool.read_row`
gives them (Qwen3.5-0.8B: 18.6 MiB, as much as ~100 of its blocks of 16 tokens). The
writer checks the snapshot row's reservation count (`StateSnapshots.generation`) after its
copy, as it checks a block's. A disk hit then runs to the last block whose state file is
there, read whole with its blocks, or not at all (`BlockManager._read_from_disk`).

Bounds. The writer keeps DIR (every model's files) under `max_bytes`: past it, it removes
the least recently used files (by mtime: a read touches its file) until 90% of it.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from qinfer.attention.kv_pool import KVPool
from qinfer.attention.state_pool import StatePool
from qinfer.core.errors import QinferError
from qinfer.engine.block_file import BadBlockFile, decode, encode, encode_key
from qinfer.engine.sequence import Sequence
from qinfer.model.transformer import Transformer

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
STATE_SUFFIX = ".kvs"
#: Prefixes a state file's key: a state and its block share the digest, never the key.
STATE_KEY = b"state:"
#: Changes when the file format or what the fingerprint covers does.
FORMAT_VERSION = b"qinfer-kv-1"
#: Elements of each weight tensor the fingerprint samples (spread over the tensor).
SAMPLED = 64
#: The writer evicts down to this fraction of max_bytes (fewer scans of DIR).
EVICT_TO = 0.9


def model_fingerprint(model: Transformer, block_size: int) -> str:
    """What makes one model's K/V blocks another's: its config, features (KV dtype,
    batch invariance, exact mode), compute dtype, KV format, KV heads, block size, and
    every weight tensor's name, shape, dtype and SAMPLED of its elements."""
    h = hashlib.blake2b(FORMAT_VERSION, digest_size=16)
    for part in (model.config, model.features, model.dtype, model.kv_format, block_size):
        h.update(repr(part).encode())
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLED)][:SAMPLED].contiguous().cpu()
        h.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class _Write:
    """A block to write: its file's name and key, its pool block id in each space and
    each pool's allocation count of that block when the request finished."""

    digest: str
    key: bytes
    block_ids: list[int]
    generations: list[int]


@dataclass(frozen=True)
class _StateWrite:
    """A state to write: its block's digest and key, the snapshot row holding it and the
    row's reservation count when the request finished."""

    digest: str
    key: bytes
    row: int
    generation: int


class DiskCache:
    """The disk tier of one engine: `digests` names a sequence's blocks, `read` gives a
    block's tensors for each pool, `save` queues blocks for the writer thread; for a hybrid
    model (`states`: its recurrent-state pool) `read_state` and `save_states` do the same
    for the state after a block."""

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int,
        fingerprint: str,
        pools: list[KVPool],
        states: StatePool | None = None,
    ) -> None:
        self.root = Path(directory)
        self.fingerprint = fingerprint
        self.folder = self.root / fingerprint
        self.max_bytes = max_bytes
        self.pools = pools
        self.states = states
        # the block manager's pools (`BlockPool`) and snapshot index (`StateSnapshots`), set
        # by it: their allocation and reservation counts
        self.block_pools: list = []
        self.snapshots = None
        self.known: set[str] = set()  # digests on disk (written or read by this process)
        self.known_states: set[str] = set()  # the same for states
        self.tokens_read = 0
        self._check_writable()
        self._warn_of_other_models()
        self._total = sum(size for _, _, size in self._files())
        self._warned_write = False
        self._jobs: queue.Queue[list[_Write] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="qinfer-disk-cache")
        self._thread.daemon = True
        self._thread.start()

    def _check_writable(self) -> None:
        """Refuse, in one line naming the flag and path, a directory this process cannot
        make or write a file into."""
        probe = self.folder / f".probe-{uuid.uuid4().hex}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            reason = error.strerror or str(error)
            raise QinferError(
                f"--prompt-cache-dir {self.root}: cannot write there ({reason})"
            ) from None

    def _warn_of_other_models(self) -> None:
        others = [p.name for p in self.root.iterdir() if p.is_dir() and p != self.folder]
        if others:
            log.warning(
                "prompt cache dir %s holds the K/V of %d other model(s) (%s): not used by this one",
                self.root,
                len(others),
                ", ".join(sorted(others)[:3]),
            )

    # -- names ------------------------------------------------------------------------

    def digests(self, seq: Sequence, count: int, block_size: int) -> list[tuple[str, bytes]]:
        """(digest, encoded key) of the first `count` blocks of `seq`."""
        out, parent = [], bytes.fromhex(self.fingerprint)
        for i in range(count):
            key = encode_key(seq.block_key(i * block_size, (i + 1) * block_size))
            parent = hashlib.blake2b(parent + key, digest_size=16).digest()
            out.append((parent.hex(), key))
        return out

    def _path(self, digest: str, suffix: str = SUFFIX) -> Path:
        return self.folder / (digest + suffix)

    # -- reading ----------------------------------------------------------------------

    def read(self, digest: str, key: bytes) -> list[list[torch.Tensor]] | None:
        """The block's tensors for each pool (`KVPool.read_block`'s), or None when no
        usable file holds it (a bad one is removed, with one warning)."""
        shapes = [shape for pool in self.pools for shape in pool.block_shapes()]
        tensors = self._read_file(digest, key, SUFFIX, shapes, self.known)
        if tensors is None:
            return None
        parts, start = [], 0
        for pool in self.pools:
            n = len(pool.tensors)
            parts.append(tensors[start : start + n])
            start += n
        return parts

    def has_state(self, digest: str) -> bool:
        """Whether a state file for the prefix ending at this block is there (not yet read)."""
        return self._path(digest, STATE_SUFFIX).exists()

    def read_state(self, digest: str, key: bytes) -> list[torch.Tensor] | None:
        """The state after the block (`StatePool.read_row`'s tensors), or None as `read`."""
        shapes = self.states.row_shapes()
        return self._read_file(digest, STATE_KEY + key, STATE_SUFFIX, shapes, self.known_states)

    def _read_file(
        self, digest: str, key: bytes, suffix: str, shapes: list, known: set[str]
    ) -> list[torch.Tensor] | None:
        """A file's tensors if it is this model's `digest` holding `key`, whole, with these
        (shape, dtype)s; else None (a bad file removed, with one warning)."""
        path = self._path(digest, suffix)
        try:
            data = path.read_bytes()
        except OSError:  # not there (or evicted by another process meanwhile)
            known.discard(digest)
            return None
        try:
            tensors = decode(data, self.fingerprint, digest, key)
            if [(t.shape, t.dtype) for t in tensors] != [(torch.Size(s), d) for s, d in shapes]:
                raise BadBlockFile("its tensors' shapes are not this pool's")
        except BadBlockFile as why:
            log.warning("prompt cache: ignoring %s: %s", path, why)
            known.discard(digest)
            path.unlink(missing_ok=True)
            return None
        try:  # least recently used last (a time of ns, not the file system's coarse clock)
            os.utime(path, ns=(time.time_ns(), time.time_ns()))
        except OSError:
            pass
        known.add(digest)
        return tensors

    # -- writing ----------------------------------------------------------------------

    def save(self, blocks: list[tuple[str, bytes, list[int]]]) -> None:
        """Queue blocks (digest, key, pool block id per space) for the writer, each
        with its pools' current allocation count; those known on disk are skipped."""
        writes = [
            _Write(digest, key, ids, self._generations(ids))
            for digest, key, ids in blocks
            if digest not in self.known
        ]
        if writes:
            self.known.update(w.digest for w in writes)
            self._jobs.put(writes)

    def save_states(self, states: list[tuple[str, bytes, int]]) -> None:
        """Queue states (digest, key of the block they follow, snapshot row) for the writer,
        each with its row's reservation count; those known on disk are skipped."""
        writes = [
            _StateWrite(digest, key, row, self.snapshots.generation[row])
            for digest, key, row in states
            if digest not in self.known_states
        ]
        if writes:
            self.known_states.update(w.digest for w in writes)
            self._jobs.put(writes)

    def _generations(self, block_ids: list[int]) -> list[int]:
        """How often each pool has allocated these blocks (a change: reused)."""
        return [
            pool.blocks[b].generation for pool, b in zip(self.block_pools, block_ids, strict=True)
        ]

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        self._jobs.join()

    def forget(self) -> int:
        """Remove this model's block files (after the queued ones are written), for
        `/flush_cache`; other models' folders are left alone. Returns the files removed."""
        self.flush()
        removed = 0
        for entry in os.scandir(self.folder):
            if entry.name.endswith((SUFFIX, STATE_SUFFIX)):
                try:
                    os.unlink(entry.path)
                except OSError:  # removed meanwhile by another process
                    continue
                removed += 1
        self.known.clear()
        self.known_states.clear()
        self._total = sum(size for _, _, size in self._files())
        return removed

    def close(self) -> None:
        """Write what is queued, then stop the writer (idempotent)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _write_loop(self) -> None:
        while True:
            writes = self._jobs.get()
            try:
                if writes is None:
                    return
                for write in writes:
                    self._write(write)
                if self._total > self.max_bytes:
                    self._evict()
            finally:
                self._jobs.task_done()

    def _write(self, write: _Write | _StateWrite) -> None:
        block = isinstance(write, _Write)
        known = self.known if block else self.known_states
        path = self._path(write.digest, SUFFIX if block else STATE_SUFFIX)
        if path.exists():  # another process wrote it
            return
        if block:
            parts = [
                pool.read_block(b) for pool, b in zip(self.pools, write.block_ids, strict=True)
            ]
            tensors, key = sum(parts, []), write.key
            # reallocated while queued: its K/V are another's
            reused = self._generations(write.block_ids) != write.generations
        else:
            tensors, key = self.states.read_row(write.row), STATE_KEY + write.key
            # taken for another prefix while queued: the state is another's
            reused = self.snapshots.generation[write.row] != write.generation
        if reused:
            known.discard(write.digest)
            return
        data = encode(self.fingerprint, write.digest, key, tensors)
        if len(data) > self.max_bytes:
            return
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            temporary.write_bytes(data)
            os.utime(temporary, ns=(time.time_ns(), time.time_ns()))  # the order of writes
            os.replace(temporary, path)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            known.discard(write.digest)
            if not self._warned_write:
                self._warned_write = True
                log.warning(
                    "prompt cache: cannot write to %s (%s): blocks stay in memory only "
                    "until it can",
                    self.folder,
                    error.strerror or error,
                )
            return
        self._total += len(data)

    def _files(self) -> list[tuple[int, Path, int]]:
        """Every model's block and state files under DIR: (mtime ns, path, bytes)."""
        found = []
        for folder in self.root.iterdir():
            if not folder.is_dir():
                continue
            for entry in os.scandir(folder):
                if entry.name.endswith((SUFFIX, STATE_SUFFIX)):
                    try:
                        stat = entry.stat()
                    except OSError:  # removed meanwhile
                        continue
                    found.append((stat.st_mtime_ns, Path(entry.path), stat.st_size))
        return found

    def _evict(self) -> None:
        """Remove the least recently used files (any model's) until DIR holds at most
        EVICT_TO of max_bytes."""
        files = sorted(self._files())
        total = sum(size for _, _, size in files)
        for _, path, size in files:
            if total <= self.max_bytes * EVICT_TO:
                break
            path.unlink(missing_ok=True)
            (self.known if path.suffix == SUFFIX else self.known_states).discard(path.stem)
            total -= size
        self._total = total
