"""Version strings of the GPU stack, parsed strictly and ordered numerically.

Three shapes matter to the compatibility contract:

- NVIDIA Linux driver: `550.54.14` (branch.minor.patch) and, for a few releases, `570.26` / `455.32`.
- CUDA toolkit / driver API: `12.4` (GA) or `12.4.1` (Update 1).
- Linux kernel release (`uname -r`): `6.1.0-27-cloud-amd64` (Debian), `5.15.0-105-generic` (Ubuntu), `6.8.12`.

String comparison gets all three wrong (`"550.100.1" < "550.54.14"`), so each is parsed into numbers once.
Anything that does not parse raises a `CubeError` with a stable code naming the layer, never a bare
`ValueError` or `IndexError`: these strings come from template files and from inside untrusted guests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Self

from cubeaccel.protocol.errors import CubeError

# NVIDIA prints the patch with two digits (470.42.01); requiring that keeps str(parse(s)) == s.
_DRIVER = re.compile(r"(\d{2,4})\.(\d{1,3})(?:\.(\d{2}))?", re.ASCII)
_CUDA = re.compile(r"(\d{1,3})\.(\d{1,3})(?:\.(\d{1,3}))?", re.ASCII)
# major.minor[.patch][-abi][-flavour]; the flavour is what Debian/Ubuntu append (cloud-amd64, generic, ...).
_KERNEL = re.compile(
    r"(\d{1,3})\.(\d{1,3})(?:\.(\d{1,4}))?(?:-(\d{1,6}))?(?:[-+.~]([A-Za-z0-9][A-Za-z0-9._+~-]{0,63}))?",
    re.ASCII,
)
_MAX_TEXT = 128


def _text(value: object, code: str, what: str, layer: str) -> str:
    if not isinstance(value, str):
        raise CubeError(code, f"{what} must be a string, got {type(value).__name__}: {value!r:.60}", layer, status=422)
    if len(value) > _MAX_TEXT:
        raise CubeError(code, f"{what} is too long ({len(value)} characters): {value[:40]!r}...", layer, status=422)
    return value


class _OrderedByKey:
    """Comparisons through `key`, so a version sorts by meaning, not by its text (and equality stays exact)."""

    @property
    def key(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def __lt__(self, other: Self) -> bool:
        return self.key < other.key

    def __le__(self, other: Self) -> bool:
        return self.key <= other.key

    def __gt__(self, other: Self) -> bool:
        return self.key > other.key

    def __ge__(self, other: Self) -> bool:
        return self.key >= other.key


@dataclass(frozen=True)
class DriverVersion(_OrderedByKey):
    """An NVIDIA driver version. `branch` is the first number (550); ordering is numeric."""

    branch: int
    minor: int
    patch: int | None = None

    @classmethod
    def parse(cls, text: object) -> DriverVersion:
        s = _text(text, "version.invalid_driver", "driver version", "kernel_driver")
        m = _DRIVER.fullmatch(s)
        if m is None:
            raise CubeError(
                "version.invalid_driver",
                f"not an NVIDIA driver version (like 550.54.14): {s!r}",
                "kernel_driver",
            )
        return cls(int(m[1]), int(m[2]), int(m[3]) if m[3] is not None else None)

    @property
    def key(self) -> tuple[int, int, int]:
        """Sort key: a missing patch sorts as 0, so `570.26` < `570.26.1`."""
        return (self.branch, self.minor, self.patch or 0)

    def at_least(self, other: DriverVersion) -> bool:
        return self.key >= other.key

    def __str__(self) -> str:
        return f"{self.branch}.{self.minor}" + (f".{self.patch:02d}" if self.patch is not None else "")


@dataclass(frozen=True, order=True)
class CudaVersion:
    """A CUDA toolkit version; `update` is the toolkit's "Update N" (12.4.1 = 12.4 Update 1)."""

    major: int
    minor: int
    update: int = 0

    @classmethod
    def parse(cls, text: object) -> CudaVersion:
        s = _text(text, "version.invalid_cuda", "CUDA version", "cuda_runtime")
        m = _CUDA.fullmatch(s)
        if m is None:
            raise CubeError("version.invalid_cuda", f"not a CUDA version (like 12.4 or 12.4.1): {s!r}", "cuda_runtime")
        return cls(int(m[1]), int(m[2]), int(m[3]) if m[3] is not None else 0)

    @classmethod
    def from_driver_api(cls, value: object) -> CudaVersion:
        """`cuDriverGetVersion` returns 1000*major + 10*minor (12040 = 12.4); strings are parsed as usual."""
        if isinstance(value, bool):
            raise CubeError("version.invalid_cuda", f"not a CUDA driver API version: {value!r}", "cuda_runtime")
        if isinstance(value, int):
            if not 1000 <= value <= 999_999:
                raise CubeError(
                    "version.invalid_cuda", f"CUDA driver API version out of range: {value}", "cuda_runtime"
                )
            return cls(value // 1000, (value % 1000) // 10)
        return cls.parse(value)

    @property
    def driver_api(self) -> int:
        return self.major * 1000 + self.minor * 10

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}" + (f".{self.update}" if self.update else "")


@dataclass(frozen=True)
class KernelVersion(_OrderedByKey):
    """A kernel release string as `uname -r` prints it. Equality is on the full text (the flavour matters:
    a `-cloud-amd64` modules.img does not load into a `-amd64` kernel); ordering is numeric first."""

    major: int
    minor: int
    patch: int
    abi: int | None
    flavour: str
    text: str

    @classmethod
    def parse(cls, text: object) -> KernelVersion:
        s = _text(text, "version.invalid_kernel", "kernel release", "guest_kernel")
        m = _KERNEL.fullmatch(s)
        if m is None:
            raise CubeError(
                "version.invalid_kernel",
                f"not a kernel release (like 6.1.0-27-cloud-amd64): {s!r}",
                "guest_kernel",
            )
        return cls(
            major=int(m[1]),
            minor=int(m[2]),
            patch=int(m[3]) if m[3] is not None else 0,
            abi=int(m[4]) if m[4] is not None else None,
            flavour=m[5] or "",
            text=s,
        )

    @property
    def key(self) -> tuple[int, int, int, int, str, str]:
        return (self.major, self.minor, self.patch, -1 if self.abi is None else self.abi, self.flavour, self.text)

    def __str__(self) -> str:
        return self.text
