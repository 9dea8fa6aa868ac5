"""Connect's envelope framing (connectrpc.com/docs/protocol): `[flags u8][length u32 big-endian][payload]`, the
last envelope of a stream flagged 0x02. One codec for every party: the guest's workload service, the host's
workload client and the front door. Stdlib only (the guest imports it); each caller turns `EnvelopeError` into
its own protocol's error."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct(">BI")
FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02


class EnvelopeError(ValueError):
    """`too_large`: a declared length over the bound (refused from the 5-byte prefix alone); `truncated`: the
    stream ended inside an envelope."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def encode(payload: bytes, flags: int = 0) -> bytes:
    return HEADER.pack(flags, len(payload)) + payload


def encode_json(message: Mapping[str, Any], flags: int = 0) -> bytes:
    return encode(json.dumps(message, separators=(",", ":")).encode(), flags)


@dataclass(frozen=True)
class Envelope:
    flags: int
    payload: bytes


class EnvelopeDecoder:
    """Bytes in, cut anywhere; whole envelopes out."""

    def __init__(self, max_message: int) -> None:
        self.max_message = max_message
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Envelope]:
        self._buf += data
        out: list[Envelope] = []
        while len(self._buf) >= HEADER.size:
            flags, length = HEADER.unpack_from(self._buf)
            if length > self.max_message:
                raise EnvelopeError("too_large", f"message of {length} bytes exceeds {self.max_message}")
            end = HEADER.size + length
            if len(self._buf) < end:
                break
            out.append(Envelope(flags, bytes(self._buf[HEADER.size : end])))
            del self._buf[:end]
        return out

    def finish(self) -> None:
        if self._buf:
            raise EnvelopeError("truncated", f"stream ended inside an envelope ({len(self._buf)} bytes)")

    @property
    def buffered(self) -> int:
        return len(self._buf)


def single(data: bytes) -> Envelope | None:
    """`data` as exactly one envelope, or None when it is not one (short, or a length that does not span it)."""
    if len(data) < HEADER.size:
        return None
    flags, length = HEADER.unpack_from(data)
    return Envelope(flags, data[HEADER.size :]) if length == len(data) - HEADER.size else None
