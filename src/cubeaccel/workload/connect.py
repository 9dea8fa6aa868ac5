"""The Connect protocol (connectrpc.com), JSON codec only: envelopes, errors, and proto3-JSON field access.

Unary:            POST /pkg.Service/Method, Content-Type application/json, body = the message; reply 200 + message,
                  or an error status with {"code": "<connect code>", "message": ...}.
Server-streaming: Content-Type application/connect+json; request = one envelope; reply 200 and envelopes
                  [flags u8][length u32 big-endian][json], the last with flags 0x02 holding {} or {"error": {...}}.

Messages are envd's (`protocol/envd_process.py`, `protocol/envd_filesystem.py`: proto3 JSON as protojson writes it); a
malformed field is `invalid_argument`, as connect-go's JSON codec answers. Unknown fields are ignored, like that
codec.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from cubeaccel.protocol import connect_envelope as envelope
from cubeaccel.protocol.proto_json import ProtoJsonError

ENVELOPE = envelope.HEADER
FLAG_COMPRESSED = envelope.FLAG_COMPRESSED
FLAG_END_STREAM = envelope.FLAG_END_STREAM
DEFAULT_MAX_MESSAGE = 1024 * 1024

# Connect code -> HTTP status for unary errors (connectrpc.com/docs/protocol#error-codes).
HTTP_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}


class ConnectError(Exception):
    def __init__(self, code: str, message: str) -> None:
        assert code in HTTP_STATUS, code
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def invalid(err: ProtoJsonError) -> ConnectError:
    """A request field of the wrong type: connect-go's answer to what its JSON codec cannot unmarshal."""
    return ConnectError("invalid_argument", str(err))


def encode_envelope(message: Mapping[str, object], flags: int = 0) -> bytes:
    return envelope.encode_json(message, flags)


def end_stream(error: ConnectError | None = None) -> bytes:
    return encode_envelope({} if error is None else {"error": error.to_json()}, FLAG_END_STREAM)


# protocol/connect_envelope.Envelope with Connect's JSON reading: the codec stays stdlib framing shared with the
# host, the message parsing and its errors are the workload service's.
@dataclass(frozen=True)
class Envelope(envelope.Envelope):
    def message(self) -> dict[str, object]:
        return parse_message(self.payload)


class EnvelopeDecoder:
    """The shared codec (`protocol/connect_envelope.py`) with Connect's errors: an oversized length is
    `resource_exhausted`, a stream cut inside an envelope `invalid_argument`."""

    def __init__(self, max_message: int = DEFAULT_MAX_MESSAGE) -> None:
        self._codec = envelope.EnvelopeDecoder(max_message)

    def feed(self, data: bytes) -> list[Envelope]:
        try:
            return [Envelope(e.flags, e.payload) for e in self._codec.feed(data)]
        except envelope.EnvelopeError as e:
            raise _connect_error(e) from None

    def finish(self) -> None:
        try:
            self._codec.finish()
        except envelope.EnvelopeError as e:
            raise _connect_error(e) from None

    @property
    def buffered(self) -> int:
        return self._codec.buffered


def _connect_error(e: envelope.EnvelopeError) -> ConnectError:
    return ConnectError("resource_exhausted" if e.kind == "too_large" else "invalid_argument", str(e))


def parse_message(payload: bytes) -> dict[str, object]:
    try:
        message = json.loads(payload.decode("utf-8")) if payload.strip() else {}
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ConnectError("invalid_argument", "message is not valid JSON") from None
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "message must be a JSON object")
    return message
