"""The Connect protocol (connectrpc.com), JSON codec only: envelopes, errors, and proto3-JSON field access.

Unary:            POST /pkg.Service/Method, Content-Type application/json, body = the message; reply 200 + message,
                  or an error status with {"code": "<connect code>", "message": ...}.
Server-streaming: Content-Type application/connect+json; request = one envelope; reply 200 and envelopes
                  [flags u8][length u32 big-endian][json], the last with flags 0x02 holding {} or {"error": {...}}.

proto3 JSON mapping as protojson writes it: lowerCamelCase names (both spellings accepted on input), bytes as
base64, enums by name, 64-bit integers as strings, default values omitted. Unknown fields are ignored, like
connect-go's JSON codec.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from cubeaccel.model import connect_envelope as envelope

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

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}


def encode_envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    return envelope.encode_json(message, flags)


def end_stream(error: ConnectError | None = None) -> bytes:
    return encode_envelope({} if error is None else {"error": error.to_json()}, FLAG_END_STREAM)


@dataclass(frozen=True)
class Envelope(envelope.Envelope):
    def message(self) -> dict[str, Any]:
        return parse_message(self.payload)


class EnvelopeDecoder:
    """The shared codec (`model/connect_envelope.py`) with Connect's errors: an oversized length is
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


def parse_message(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload.decode("utf-8")) if payload.strip() else {}
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ConnectError("invalid_argument", "message is not valid JSON") from None
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "message must be a JSON object")
    return message


# ---- proto3 JSON field access ------------------------------------------------------------------------------


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def get(msg: dict[str, Any], name: str) -> Any:
    """A field by its proto name, accepting the JSON (lowerCamelCase) or the original spelling; null = absent."""
    value = msg.get(_camel(name))
    return msg.get(name) if value is None else value


def get_str(msg: dict[str, Any], name: str, default: str = "") -> str:
    value = get(msg, name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ConnectError("invalid_argument", f"{name} must be a string")
    return value


def get_opt_str(msg: dict[str, Any], name: str) -> str | None:
    return None if get(msg, name) is None else get_str(msg, name)


def get_bool(msg: dict[str, Any], name: str, default: bool = False) -> bool:
    value = get(msg, name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConnectError("invalid_argument", f"{name} must be a boolean")
    return value


def get_uint32(msg: dict[str, Any], name: str, default: int = 0) -> int:
    value = get(msg, name)
    if value is None:
        return default
    if isinstance(value, str):  # protojson accepts numbers as strings
        try:
            value = int(value)
        except ValueError:
            raise ConnectError("invalid_argument", f"{name} must be an integer") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 0xFFFFFFFF:
        raise ConnectError("invalid_argument", f"{name} must be a uint32")
    return value


def get_obj(msg: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = get(msg, name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConnectError("invalid_argument", f"{name} must be an object")
    return value


def get_str_list(msg: dict[str, Any], name: str) -> list[str]:
    value = get(msg, name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConnectError("invalid_argument", f"{name} must be a list of strings")
    return value


def get_str_map(msg: dict[str, Any], name: str) -> dict[str, str]:
    value = get(msg, name)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ConnectError("invalid_argument", f"{name} must be a map of strings")
    return value


def get_bytes(msg: dict[str, Any], name: str) -> bytes | None:
    value = get(msg, name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConnectError("invalid_argument", f"{name} must be base64")
    try:  # protojson accepts standard or URL-safe alphabets, padded or not
        return base64.b64decode(value.replace("-", "+").replace("_", "/") + "=" * (-len(value) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ConnectError("invalid_argument", f"{name} is not valid base64") from None


def get_enum(msg: dict[str, Any], name: str, values: dict[str, int]) -> int:
    value = get(msg, name)
    if value is None:
        return 0
    if isinstance(value, str):
        if value not in values:
            raise ConnectError("invalid_argument", f"unknown {name} {value[:64]!r}")
        return values[value]
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConnectError("invalid_argument", f"{name} must be an enum name or number")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
