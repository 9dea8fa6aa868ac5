"""What a failed compatibility check says: the layer that did not match, what was expected and found.

Kept separate from `contract` so the per-stage check modules can share it without import cycles.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from cubeaccel.protocol import error_catalog


class Layer(StrEnum):
    """The layers of a GPU sandbox's stack, bottom up. Every violation names exactly one."""

    HOST_HARDWARE = "host_hardware"
    BACKEND = "backend"
    TEMPLATE = "template"
    GUEST_KERNEL = "guest_kernel"
    MODULES_IMG = "modules_img"
    KERNEL_DRIVER = "kernel_driver"
    USERSPACE_DRIVER = "userspace_driver"
    CUDA_RUNTIME = "cuda_runtime"
    PINNED_MEMORY = "pinned_memory"


@dataclass(frozen=True)
class ContractViolation:
    """One mismatch. `code` is stable (`compat.<layer>_<what>`); `expected`/`found` are short and human."""

    layer: Layer
    code: str
    expected: str
    found: str
    hint: str = ""

    def __post_init__(self) -> None:
        error_catalog.check(self.code)

    def to_json(self) -> dict[str, object]:
        return {
            "layer": self.layer.value,
            "code": self.code,
            "expected": self.expected,
            "found": self.found,
            "hint": self.hint,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ContractViolation:
        return cls(
            layer=Layer(data["layer"]),
            code=str(data["code"]),
            expected=str(data["expected"]),
            found=str(data["found"]),
            hint=str(data.get("hint", "")),
        )

    def __str__(self) -> str:
        return f"{self.code} [{self.layer.value}]: expected {self.expected}, found {self.found}"
