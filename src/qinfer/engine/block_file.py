"""One KV block as a file of the prompt cache's disk tier (`qinfer.engine.disk_cache`).

    MAGIC (8 bytes) | header length (u32, little-endian) | header (JSON) | payload

The header names the model fingerprint, the block's chained digest and its key (the
prefix cache's `Sequence.block_key`: token ids, then image digests, as bytes), the shape and
dtype of each tensor, the payload's length and its crc32. The payload is the block's
tensors, raw, one after the other: keys and values (and their scales when the KV cache is
quantized), (layers, block_size, Hkv, X) each, as `KVPool.read_block` gives them. A hybrid
model's state after a block is kept in the same format (its key tagged: `disk_cache`).

`decode` refuses a file that is not exactly what was asked for (`BadBlockFile`, saying
why): another magic, a short or long payload, a crc mismatch, another model's fingerprint
or another block's digest or key. Such a file is never used.
"""

from __future__ import annotations

import json
import struct
import zlib

import torch

MAGIC = b"QKVBLK1\n"
_LENGTH = struct.Struct("<I")


class BadBlockFile(ValueError):
    """A block file that must not be used; the message says why."""


def encode_key(key: tuple[int | bytes, ...]) -> bytes:
    """A block key as bytes: each token id as 8 bytes, each image digest tagged with its
    length (so that no two keys share an encoding)."""
    parts = []
    for item in key:
        if isinstance(item, bytes):
            parts.append(b"b" + _LENGTH.pack(len(item)) + item)
        else:
            parts.append(b"i" + int(item).to_bytes(8, "little", signed=True))
    return b"".join(parts)


def encode(fingerprint: str, digest: str, key: bytes, tensors: list[torch.Tensor]) -> bytes:
    """The file's bytes for one block's tensors (contiguous, on the CPU)."""
    payload = b"".join(t.view(torch.uint8).numpy().tobytes() for t in tensors)
    header = {
        "fingerprint": fingerprint,
        "digest": digest,
        "key": key.hex(),
        "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors],
        "payload_bytes": len(payload),
        "crc32": zlib.crc32(payload),
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(text)) + text + payload


def decode(data: bytes, fingerprint: str, digest: str, key: bytes) -> list[torch.Tensor]:
    """The tensors of a block file's bytes, if it is this model's block `digest` holding
    `key`, whole and unaltered; else `BadBlockFile`, saying why."""
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start or not data.startswith(MAGIC):
        raise BadBlockFile("not a qinfer KV block file (magic)")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    try:
        header = json.loads(data[start : start + length])
        size, crc = header["payload_bytes"], header["crc32"]
        tensors = header["tensors"]
    except (ValueError, KeyError, TypeError):
        raise BadBlockFile("its header is unreadable (truncated?)") from None
    if header.get("fingerprint") != fingerprint:
        raise BadBlockFile("it holds another model's K/V (fingerprint)")
    if header.get("digest") != digest or header.get("key") != key.hex():
        raise BadBlockFile("it holds another block (digest or key)")
    payload = memoryview(data)[start + length :]
    if len(payload) != size:
        raise BadBlockFile(f"its payload has {len(payload)} bytes, the header says {size}")
    if zlib.crc32(payload) != crc:
        raise BadBlockFile("its payload fails the checksum (crc32)")
    out, offset = [], 0
    for dtype_name, shape in tensors:
        dtype = getattr(torch, dtype_name)
        count = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.frombuffer(bytearray(payload[offset : offset + count]), dtype=torch.uint8)
        out.append(raw.view(dtype).reshape(shape))
        offset += count
    if offset != size:
        raise BadBlockFile("its tensors do not fill its payload")
    return out
