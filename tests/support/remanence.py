"""Tenants in sequence on one memory stand-in (ivshmem-plain over the device's own file; docs/scrub.md): each scans
all of the device's memory for earlier tenants' canaries, then fills it with its own. Shared by the VM test (a few
tenants, both ways) and bench/remanence_bench.py (the 50-tenant run and the scrub's rates)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.model.states import DeviceState
from cubeaccel.wire.cubelet_api import Device
from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll
from tests.workload_client import WorkloadClient

# Runs in the tenant's guest as root: find the ivshmem function, scan its BAR2 whole, then fill it with canaries.
CANARY_SCRIPT = """
import glob, json, sys
from pathlib import Path
from cubeaccel.agent.scrub import fill_canary, scan_canary
dev = next(Path(p).parent for p in glob.glob("/sys/bus/pci/devices/*/vendor")
           if open(p).read().strip() == "0x1af4" and open(Path(p).parent / "device").read().strip() == "0x1110")
found = scan_canary(dev)
found["filled"] = fill_canary(dev, sys.argv[1])
print(json.dumps(found))
"""


@dataclass
class Tenancy:
    sandbox: str
    device: str
    found: dict[str, Any]  # what this tenant's scan found before it wrote its own canaries
    scrub: dict[str, Any] = field(default_factory=dict)  # the scrub_finished details after its release (if any)
    release_s: float = 0.0  # release → allocatable, host side


def devices(p: CubeletProcess) -> dict[str, Device]:
    return {d.id: d for d in p.client.devices()}


def tenant(p: CubeletProcess, sid: str) -> Tenancy:
    body = p.client.reserve(sid, 1, start=True, memory_mib=256)
    dev = body.devices[0].id

    def running() -> bool:
        res = p.client.reservation(sid).reservation
        return res is not None and res.phase is ReservationPhase.RUNNING

    poll(running, 180)
    http = httpx.Client(
        transport=httpx.HTTPTransport(uds=str(p.state_dir / "cubelet.sock")),
        base_url=f"http://cubelet/v1/sandboxes/{sid}/workload",
        timeout=120,
    )
    assert body.access_token is not None
    wl = WorkloadClient(http, body.access_token)
    s = wl.run(f"PYTHONPATH=/opt/cubeaccel python3 -c '{CANARY_SCRIPT}' '{sid}'", user="root")
    assert s.end.get("exitCode", 0) == 0, (s.end, s.output("stderr"))
    found = dict(json.loads(s.output().decode().strip().splitlines()[-1]))
    return Tenancy(sid, dev, found)


def release(p: CubeletProcess, t: Tenancy) -> None:
    """Release and wait until the device is allocatable again (after its scrub, when one is owed)."""
    import time

    seen = {e.seq for e in p.client.events(0, 10000).events if e.kind == "scrub_finished"}
    t0 = time.monotonic()
    p.client.release(t.sandbox)
    poll(lambda: devices(p)[t.device].state is DeviceState.ALLOCATABLE, 300)
    t.release_s = time.monotonic() - t0
    done = [
        e
        for e in p.client.events(0, 10000).events
        if e.kind == "scrub_finished" and e.device_id == t.device and e.seq not in seen
    ]
    t.scrub = done[-1].details if done else {}


def run(p: CubeletProcess, n: int, prefix: str = "tenant") -> list[Tenancy]:
    out = []
    for i in range(n):
        t = tenant(p, f"{prefix}-{i}")
        release(p, t)
        out.append(t)
    return out


def memory_files(state_dir: Path) -> list[Path]:
    return sorted((state_dir / "device-memory").glob("*.mem"))
