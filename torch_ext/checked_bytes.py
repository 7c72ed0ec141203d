"""Bytes kept on disk with their length and sha256 in a header: the framing of every file torch_ext
writes for a later process (the artifact cache, backend/compile/cache.py; our compiled CUDA modules,
kernels/module_cache.py). At the bottom of the layers, so both reach it."""
from __future__ import annotations

import hashlib

MAGIC = b"TORCH_EXT_ARTIFACT v1\n"


class DamagedEntry(Exception):
    pass


def pack(payload: bytes) -> bytes:
    return MAGIC + f"{len(payload)} {hashlib.sha256(payload).hexdigest()}\n".encode() + payload


def unpack(data: bytes) -> bytes:
    """The payload of pack's bytes; DamagedEntry (saying what) where the header or the payload is wrong."""
    if not data.startswith(MAGIC):
        raise DamagedEntry("bad header")
    head_end = data.find(b"\n", len(MAGIC))
    if head_end < 0:
        raise DamagedEntry("truncated header")
    try:
        length_text, digest = data[len(MAGIC):head_end].decode().split(" ")
        length = int(length_text)
    except (UnicodeDecodeError, ValueError) as e:
        raise DamagedEntry("unreadable header") from e
    payload = data[head_end + 1:]
    if len(payload) != length:
        raise DamagedEntry(f"truncated: {len(payload)} of {length} bytes")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise DamagedEntry("sha256 mismatch")
    return payload
