"""The two bases every wire model builds on: strict shapes, and messages that carry a version.

A message names its version in `v` (`version` is taken: the heartbeat's `version` is the package's). A body
without `v` is version 1, the shape every sender wrote before the field existed; any other value is refused
with an `unsupported_version` error that names what this build reads, never half-parsed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)
from pydantic_core import PydanticCustomError

from cubeaccel.protocol.errors import CubeError

WIRE_VERSION = 1
UNSUPPORTED_VERSION = "unsupported_version"  # the pydantic error type; the edges turn it into a stable code


class Strict(BaseModel):
    """Unknown fields are refused: a typo or a newer sender's field fails loudly instead of being ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Lenient(BaseModel):
    """Unknown fields are ignored: for documents read back from storage or sent by a newer peer."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


def _check_version(cls: type[BaseModel], value: Any) -> Any:
    if isinstance(value, bool) or value != WIRE_VERSION:
        raise PydanticCustomError(
            UNSUPPORTED_VERSION,
            "unsupported {kind} version {got}: this build reads v{known}",
            {"kind": cls.__name__, "got": repr(value)[:40], "known": WIRE_VERSION},
        )
    return value


class Message(Strict):
    """A strict top-level message with its version."""

    v: Literal[1] = 1

    @field_validator("v", mode="before")
    @classmethod
    def _known_version(cls, value: Any) -> Any:
        return _check_version(cls, value)


class LenientMessage(Lenient):
    """A lenient top-level message with its version (extra fields ignored, unknown versions still refused)."""

    v: Literal[1] = 1

    @field_validator("v", mode="before")
    @classmethod
    def _known_version(cls, value: Any) -> Any:
        return _check_version(cls, value)


def field_path(loc: tuple[int | str, ...]) -> str:
    """("devices", 0, "driver") → "devices[0].driver", as the hand validators named fields."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def finite(raw: Any) -> float:
    """A finite JSON number: `"nan"`, NaN/Infinity literals and 1e400 would reach the database or the math."""
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise ValueError(f"must be a finite number, got {raw!r:.40}")
    return float(raw)


def count(raw: Any) -> int:
    """A whole number in 0..2^53 (device counts, MiB): what a JSON number carries exactly."""
    value = finite(raw)
    if not 0 <= value <= 2**53 or value != int(value):
        raise ValueError(f"must be an integer in 0..2^53, got {raw!r:.40}")
    return int(value)


Finite = Annotated[float, BeforeValidator(finite)]
Count = Annotated[int, BeforeValidator(count), Field(ge=0, le=2**53)]


class Record(BaseModel):
    """A reply's nested record: the documented fields are typed; any others pass through unchanged, so a reply
    model never drops what a handler sends."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)


class Reply(Record):
    """A top-level reply body, with its version."""

    v: Literal[1] = 1


def _leave_out_unset(self: BaseModel, handler: SerializerFunctionWrapHandler) -> Any:
    out = handler(self)
    if not isinstance(out, dict):
        return out
    fields = type(self).model_fields
    unset = {  # by name or by alias, however it was dumped
        key for name in fields.keys() - self.model_fields_set for key in (name, fields[name].serialization_alias)
    }
    return {k: v for k, v in out.items() if k not in unset}


# Without a declared return type the serializer leaves the model's own fields as its JSON schema: `Any` would
# document every Sparse reply as `{}`.
del _leave_out_unset.__annotations__["return"]


class Sparse(Record):
    """A stored document nested in a reply, whose writer left out what it did not have: a field that was not
    given stays out of the JSON (absent is not null), as it was stored."""

    _sparse = model_serializer(mode="wrap")(_leave_out_unset)


CUBE_ERROR = "cube_error"  # the pydantic error type of a field whose own parser raised a catalogued CubeError


def cube_error_field(e: CubeError) -> PydanticCustomError:
    """A field parser's `CubeError` as a validation error that keeps it: the edge answers with its code, status
    and message when it is the only thing wrong with a body (`carried_cube_error`)."""
    return PydanticCustomError(CUBE_ERROR, "{message}", {"message": e.message, "error": e})


def carried_cube_error(errors: Sequence[Mapping[str, Any]]) -> CubeError | None:
    """The `CubeError` a body failed on alone, or None when anything else is wrong with it too."""
    if len(errors) != 1 or errors[0].get("type") != CUBE_ERROR:
        return None
    found = (errors[0].get("ctx") or {}).get("error")
    return found if isinstance(found, CubeError) else None
