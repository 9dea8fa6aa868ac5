#!/usr/bin/env python3
"""Read-only GPU host discovery for a real machine: prints one JSON document and exits 0.

Runs `cubeaccel host check` and VFIO discovery through `SysfsPciHost(read_only=True)` on the real
/sys, and reports every PCI function, the accelerators with their labels, IOMMU groups (members and
drivers), reset methods, AER counters, what the VFIO backend would say about each accelerator, and
which processes hold /dev/nvidia* or /dev/vfio/* open.

It NEVER writes to sysfs, rebinds a driver or resets a device. Two independent guards:
1. the host is opened with `read_only=True`, which raises before any write;
2. a Python audit hook refuses any open() for writing under /sys, /proc or /dev for the whole process.

Usage: python3 scripts/gpu-discover.py [--allow 10de:*] [--sysfs-root /sys] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

_GUARDED = ("/sys", "/proc", "/dev")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _no_writes(event: str, args: tuple[Any, ...]) -> None:
    """Audit hook: abort any open-for-write of a path under /sys, /proc or /dev."""
    if event != "open" or not args:
        return
    path, mode, flags = [*args, None, None][:3]
    if not isinstance(path, (str, bytes, os.PathLike)):
        return
    text = os.fsdecode(path)
    if not os.path.isabs(text):
        text = os.path.join(os.getcwd(), text)
    text = os.path.realpath(text)
    if not any(text == g or text.startswith(g + "/") for g in _GUARDED):
        return
    writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        isinstance(flags, int) and flags & _WRITE_FLAGS
    )
    if writing:
        raise PermissionError(f"gpu-discover is read-only: refusing to open {text} for writing")


sys.addaudithook(_no_writes)

try:
    import cubeaccel  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from cubeaccel.backends.vfio import VfioBackend  # noqa: E402
from cubeaccel.host.pci import procfs  # noqa: E402
from cubeaccel.host.pci.base import function_json  # noqa: E402
from cubeaccel.host.pci.readiness import check_host  # noqa: E402
from cubeaccel.host.pci.sysfs import SysfsPciHost  # noqa: E402
from cubeaccel.model.device import DeviceRecord  # noqa: E402
from cubeaccel.model.states import DeviceState  # noqa: E402


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sysfs-root", default="/sys")
    ap.add_argument("--allow", action="append", default=None, help="vendor:device pattern (default 10de:*)")
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    ap.add_argument(
        "--holder-scan-exempt-pid",
        type=int,
        action="append",
        default=[],
        help="a process whose fds cannot be read but that holds no device (repeatable)",
    )
    opts = ap.parse_args()

    started = time.monotonic()
    host = SysfsPciHost(opts.sysfs_root, read_only=True, exempt_pids=frozenset(opts.holder_scan_exempt_pid))
    backend = VfioBackend(host, allow=opts.allow or ["10de:*"])
    readiness = check_host(opts.sysfs_root)
    t0 = time.monotonic()
    functions = host.functions()
    t_functions = time.monotonic() - t0
    t0 = time.monotonic()
    devices = backend.discover()
    t_discover = time.monotonic() - t0

    groups: dict[int, list[dict[str, Any]]] = {}
    for fn in functions:
        if fn.iommu_group is not None:
            member = {"address": str(fn.address), "id": fn.identity.vendor_device, "class": f"{fn.class_code:06x}"}
            groups.setdefault(fn.iommu_group, []).append({**member, "driver": fn.driver, "bridge": fn.is_bridge})

    accelerators = []
    for d in devices:
        f = host.function(d.address)
        if f is None:
            continue
        record = DeviceRecord(
            id=d.device_id, address=d.address, identity=d.identity, accel_class=d.accel_class, backend=d.backend,
            numa_node=d.numa_node, iommu_group=d.iommu_group, expected_driver="vfio-pci", labels=d.labels,
            state=DeviceState.INITIALIZED, generation=0, reason=None, sandbox_id=None, updated_at=0.0,
        )  # fmt: skip
        t0 = time.monotonic()
        problems = backend.validate(record)  # read-only: sysfs/config/proc reads only
        validate_ms = (time.monotonic() - t0) * 1000
        accelerators.append(
            {
                **function_json(f),
                "accel_class": d.accel_class.value,
                "labels": d.labels,
                "device_files": host.device_files(d.address),
                "holders": [h.__dict__ for h in host.holders(d.address)],
                "group_offenders": backend.group_offenders(f),
                "nvidia_information": _read(Path("/proc/driver/nvidia/gpus") / str(f.address) / "information"),
                "validate_if_selected": [{"code": p.code, "hard": p.hard, "message": p.message} for p in problems],
                "validate_ms": round(validate_ms, 2),
            }
        )

    holders = procfs.find_holders(procfs.any_of(procfs.glob("/dev/nvidia*"), procfs.glob("/dev/vfio/*")))
    report = {
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "read_only": host.read_only,
        "readiness": readiness.to_json(),
        "allow": list(backend.allow),
        "accelerators": accelerators,
        "iommu_groups": {str(k): v for k, v in sorted(groups.items())},
        "holders": [h.__dict__ for h in holders],
        "nvidia_driver_version": (_read(Path("/proc/driver/nvidia/version")) or "").strip() or None,
        "functions": [function_json(f) for f in functions],
        "timings_ms": {
            "functions": round(t_functions * 1000, 2),
            "discover": round(t_discover * 1000, 2),
            "total": round((time.monotonic() - started) * 1000, 2),
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if opts.out:
        Path(opts.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
