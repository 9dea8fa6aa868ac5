"""The compatibility facts the contract is checked against, as data, each table with its source.

Kept in one module so that updating to a new CUDA or driver release is a data change reviewed against
the cited page, not a code change. Versions are kept as the strings NVIDIA prints and parsed on use.

Sources (checked 2026-11; numbers copied from the tables, not derived):

[T3] NVIDIA CUDA Toolkit Release Notes, "Table 3: CUDA Toolkit and Corresponding Driver Versions"
     https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/index.html (Linux x86_64 column).
[MV] NVIDIA CUDA Compatibility, "Minor Version Compatibility", table "CUDA Toolkit 11.x, 12.x, and 13.x
     Minimum Required Driver Versions" https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html
     and the release notes' "CUDA Toolkit and Minimum Required Driver Version for CUDA Minor Version
     Compatibility" (12.x >= 525.60.13, 11.x >= 450.80.02 on Linux; 13.x >= 580).
[DC] NVIDIA Data Center GPU Driver release notes, "Supported hardware", per branch
     https://docs.nvidia.com/datacenter/tesla/ (R450 adds Ampere/A100, R525 is the first production branch
     listing H100 and the Ada data-center parts, R570 adds Blackwell/B200), and
     https://docs.nvidia.com/datacenter/tesla/drivers/supported-drivers-and-cuda-toolkit-versions.html
"""

from __future__ import annotations

from dataclasses import dataclass

# --- [T3] CUDA toolkit (major, minor, update) → minimum Linux x86_64 driver --------------------------------
CUDA_TOOLKIT_MIN_DRIVER: dict[tuple[int, int, int], str] = {
    (13, 0, 2): "580.95.05",
    (13, 0, 1): "580.82.07",
    (13, 0, 0): "580.65.06",
    (12, 9, 1): "575.57.08",
    (12, 9, 0): "575.51.03",
    (12, 8, 1): "570.124.06",
    (12, 8, 0): "570.26",
    (12, 6, 3): "560.35.05",
    (12, 6, 2): "560.35.03",
    (12, 6, 1): "560.35.03",
    (12, 6, 0): "560.28.03",
    (12, 5, 1): "555.42.06",
    (12, 5, 0): "555.42.02",
    (12, 4, 1): "550.54.15",
    (12, 4, 0): "550.54.14",
    (12, 3, 1): "545.23.08",
    (12, 3, 0): "545.23.06",
    (12, 2, 2): "535.104.05",
    (12, 2, 1): "535.86.09",
    (12, 2, 0): "535.54.03",
    (12, 1, 1): "530.30.02",
    (12, 1, 0): "530.30.02",
    (12, 0, 1): "525.85.12",
    (12, 0, 0): "525.60.13",
    (11, 8, 0): "520.61.05",
    (11, 7, 1): "515.48.07",
    (11, 7, 0): "515.43.04",
    (11, 6, 2): "510.47.03",
    (11, 6, 1): "510.47.03",
    (11, 6, 0): "510.39.01",
    (11, 5, 2): "495.29.05",
    (11, 5, 1): "495.29.05",
    (11, 5, 0): "495.29.05",
    (11, 4, 4): "470.82.01",
    (11, 4, 3): "470.82.01",
    (11, 4, 2): "470.57.02",
    (11, 4, 1): "470.57.02",
    (11, 4, 0): "470.42.01",
    (11, 3, 1): "465.19.01",
    (11, 3, 0): "465.19.01",
    (11, 2, 2): "460.32.03",
    (11, 2, 1): "460.32.03",
    (11, 2, 0): "460.27.03",
    (11, 1, 1): "455.32",
    (11, 1, 0): "455.23",
    (11, 0, 3): "450.51.06",
    (11, 0, 2): "450.51.05",
}

# --- [MV] CUDA major → minimum driver under minor-version compatibility --------------------------------------
# An application built with any 12.x toolkit runs (with a limited feature set: no newer-PTX JIT) on a driver
# of at least this version. NVIDIA lists 13.x as ">= 580"; 580.65.06 is the first R580 driver in [T3].
CUDA_MINOR_COMPAT_MIN_DRIVER: dict[int, str] = {
    11: "450.80.02",
    12: "525.60.13",
    13: "580.65.06",
}


# --- [DC] GPU architecture → first driver that supports it ---------------------------------------------------
@dataclass(frozen=True)
class ArchitectureSupport:
    architecture: str
    min_driver: str  # first production driver listing the architecture
    source: str


ARCHITECTURE_MIN_DRIVER: dict[str, ArchitectureSupport] = {
    a.architecture: a
    for a in (
        ArchitectureSupport("turing", "418.39", "[DC] R418; CUDA 10.1 driver in [T3]"),
        ArchitectureSupport("ampere", "450.51.05", "[DC] R450 adds A100; CUDA 11.0 GA (first sm_80) in [T3]"),
        ArchitectureSupport("ada", "525.60.13", "[DC] R525 lists L4/L40; CUDA 12.0 GA driver in [T3]"),
        ArchitectureSupport("hopper", "525.60.13", "[DC] R525 first production branch with H100; CUDA 12.0 GA"),
        ArchitectureSupport("blackwell", "570.26", "[DC] R570 adds B200; CUDA 12.8 GA (first sm_100) in [T3]"),
    )
}


# --- backends this build knows (entry points add more in a later issue) --------------------------------------
@dataclass(frozen=True)
class BackendInfo:
    name: str
    dma: bool  # the device does DMA into guest memory: hot-plug needs all guest memory pinned first
    description: str


KNOWN_BACKENDS: dict[str, BackendInfo] = {
    b.name: b
    for b in (
        BackendInfo("vfio", True, "VFIO PCI passthrough of a whole function (the reference backend)"),
        BackendInfo("emulated", False, "a QEMU-emulated PCI device (edu, 1234:11e8); no host device, no DMA"),
    )
}
