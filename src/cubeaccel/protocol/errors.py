"""Errors are values with a stable code and the layer that failed; they reach users verbatim.

Every code is listed, with its HTTP status, in `protocol/error_catalog.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cubeaccel.protocol import error_catalog


@dataclass
class CubeError(Exception):
    """Base error: `code` is stable (scripts match on it), `layer` names where it failed.

    `status` 0 (the default) takes the catalog's HTTP status for the code (400 where it has none).
    """

    code: str
    message: str
    layer: str = "cubelet"
    details: dict[str, Any] = field(default_factory=dict)
    status: int = 0

    def __post_init__(self) -> None:
        super().__init__(f"{self.code}: {self.message}")
        error_catalog.check(self.code, self.status or None)
        if not self.status:
            self.status = error_catalog.default_status(self.code)

    def to_json(self) -> dict[str, Any]:
        return {
            "error": {
                "code": self.code,
                "layer": self.layer,
                "message": self.message,
                "details": self.details,
            }
        }


def invalid(code: str, message: str, layer: str = "api", **details: Any) -> CubeError:
    return CubeError(code=code, message=message, layer=layer, details=details, status=422)


def not_found(code: str, message: str, **details: Any) -> CubeError:
    return CubeError(code=code, message=message, layer="api", details=details, status=404)


def conflict(code: str, message: str, layer: str = "cubelet", details: dict[str, Any] | None = None) -> CubeError:
    return CubeError(code=code, message=message, layer=layer, details=details or {}, status=409)
