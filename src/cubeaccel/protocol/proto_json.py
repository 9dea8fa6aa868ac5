"""proto3 JSON as envd's messages (`protocol/envd_process.py`, `protocol/envd_filesystem.py`) are read and written.

Written as the guest's service has always written them, which is protojson's form: lowerCamelCase, int64 as a
string, bytes as base64, defaults omitted (a few fields envd always sets are always written, and key order is
kept); a field that is `None` in a message is absent on the wire, and a oneof is read in the order the service
has always tried its members (the first one set wins).

Read leniently where protojson is: a field by its lowerCamelCase or original name, null read as absent, numbers
given as strings, base64 in either alphabet with or without padding. Strict on type: a field of the wrong type is a
`ProtoJsonError` naming the field, which the guest answers as Connect's `invalid_argument` and the host's client
as a bad reply. Stdlib only: the guest imports it.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass

Json = Mapping[str, object]  # a decoded JSON object, read field by field


class ProtoJsonError(ValueError):
    """A field proto3 JSON cannot read as its declared type; the text names the field."""


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def get(msg: Json, name: str) -> object:
    """A field by its proto name, accepting the JSON (lowerCamelCase) or the original spelling; null = absent."""
    value = msg.get(_camel(name))
    return msg.get(name) if value is None else value


def get_str(msg: Json, name: str, default: str = "") -> str:
    value = get(msg, name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ProtoJsonError(f"{name} must be a string")
    return value


def get_opt_str(msg: Json, name: str) -> str | None:
    return None if get(msg, name) is None else get_str(msg, name)


def get_bool(msg: Json, name: str, default: bool = False) -> bool:
    value = get(msg, name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtoJsonError(f"{name} must be a boolean")
    return value


def get_opt_bool(msg: Json, name: str) -> bool | None:
    return None if get(msg, name) is None else get_bool(msg, name)


def _integer(value: object, name: str, kind: str) -> int:
    if isinstance(value, str):  # protojson accepts numbers as strings
        try:
            value = int(value)
        except ValueError:
            raise ProtoJsonError(f"{name} must be an integer") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtoJsonError(f"{name} must be a {kind}")
    return value


def get_uint32(msg: Json, name: str, default: int = 0) -> int:
    value = get(msg, name)
    if value is None:
        return default
    number = _integer(value, name, "uint32")
    if not 0 <= number <= 0xFFFFFFFF:
        raise ProtoJsonError(f"{name} must be a uint32")
    return number


def get_int32(msg: Json, name: str, default: int = 0) -> int:
    value = get(msg, name)
    if value is None:
        return default
    number = _integer(value, name, "int32")
    if not -(2**31) <= number < 2**31:
        raise ProtoJsonError(f"{name} must be an int32")
    return number


def get_int64(msg: Json, name: str, default: int = 0) -> int:
    value = get(msg, name)
    if value is None:
        return default
    number = _integer(value, name, "int64")
    if not -(2**63) <= number < 2**63:
        raise ProtoJsonError(f"{name} must be an int64")
    return number


def get_obj(msg: Json, name: str) -> Json | None:
    value = get(msg, name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtoJsonError(f"{name} must be an object")
    return value


def get_list(msg: Json, name: str) -> list[object]:
    value = get(msg, name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ProtoJsonError(f"{name} must be a list")
    return value


def get_objs(msg: Json, name: str) -> list[Json]:
    items = get_list(msg, name)
    if not all(isinstance(v, dict) for v in items):
        raise ProtoJsonError(f"{name} must be a list of objects")
    return [v for v in items if isinstance(v, dict)]


def get_str_list(msg: Json, name: str) -> list[str]:
    value = get(msg, name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ProtoJsonError(f"{name} must be a list of strings")
    return [v for v in value if isinstance(v, str)]


def get_str_map(msg: Json, name: str) -> dict[str, str]:
    value = get(msg, name)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ProtoJsonError(f"{name} must be a map of strings")
    return {str(k): str(v) for k, v in value.items()}


def get_bytes(msg: Json, name: str) -> bytes | None:
    value = get(msg, name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ProtoJsonError(f"{name} must be base64")
    try:  # protojson accepts standard or URL-safe alphabets, padded or not
        return base64.b64decode(value.replace("-", "+").replace("_", "/") + "=" * (-len(value) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ProtoJsonError(f"{name} is not valid base64") from None


def get_enum(msg: Json, name: str, values: Mapping[str, int]) -> int:
    value = get(msg, name)
    if value is None:
        return 0
    if isinstance(value, str):
        if value not in values:
            raise ProtoJsonError(f"unknown {name} {value[:64]!r}")
        return values[value]
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ProtoJsonError(f"{name} must be an enum name or number")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@dataclass(frozen=True)
class Empty:
    """The reply of the calls that answer nothing (and `{}` read back)."""

    def to_json(self) -> dict[str, object]:
        return {}

    @classmethod
    def from_json(cls, msg: Json) -> Empty:
        return cls()
