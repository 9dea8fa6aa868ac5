"""`make demo`: one GPU-style sandbox end to end on the embedded single-node default, with its timeline.

`cubeaccel up` picks the backend and says why: `emulated` (a real QEMU MicroVM hot-plugging the emulated
`edu` PCI device) where QEMU runs and the guest image builds; otherwise `simulated`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from cubeaccel.cli.render import console, device_table, event_table
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.cubelet_client import CubeletClient
from cubeaccel.wire.cubelet_api import Device, Event


def wait_for(fn: Any, what: str, deadline_s: float = 120.0) -> Any:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            value = fn()
        except (CubeError, OSError, Exception):
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


def _events(client: CubeletClient, sid: str) -> list[Event]:
    return client.events(0, 10000, sandbox_id=sid).events


def _has(client: CubeletClient, device_id: str, state: DeviceState) -> bool:
    return any(d.id == device_id and d.state is state for d in client.devices())


def _table(devices: list[Device], title: str) -> Table:
    return device_table([d.model_dump(mode="json", by_alias=True) for d in devices], title=title)


def print_timeline(events: list[Event]) -> None:
    if not events:
        return
    t0 = events[0].at
    console.print("[bold]sandbox timeline[/bold] (seconds since the reservation, from Cubelet's event journal)")
    for e in events:
        label = e.event or e.kind
        if e.kind == EventKind.TRANSITION:
            label = f"{e.device_id}: {e.from_state} → {e.to_state}"
        console.print(f"  {e.at - t0:7.3f}s  {label}")
    shim = [e for e in events if e.event == "shim_exiting"]
    if shim and shim[-1].details.get("timeline"):
        console.print("[bold]shim phase breakdown[/bold] (seconds, measured by the shim)")
        for k, v in shim[-1].details["timeline"].items():
            console.print(f"  {k:<24} {v:8.3f}")


# Every PCI function the guest sees whose ids are the emulated edu device's (1234:11e8), from sysfs.
GUEST_DEVICE_SCRIPT = (
    "for d in /sys/bus/pci/devices/*; do v=$(cat $d/vendor); i=$(cat $d/device); "
    "drv=$(readlink $d/driver 2>/dev/null); "
    'if [ "$v:$i" = "0x1234:0x11e8" ]; then echo "$(basename $d) vendor=$v device=$i driver=${drv:-none}"; fi; done'
)


def show_device_in_guest(cubelet_url: str, sid: str, token: str) -> None:
    """A command run inside the sandbox (through Cubelet's proxy, as `cubeaccel sandbox exec` does) that shows
    the hot-plugged device as the guest kernel sees it."""
    from cubeaccel.transport.workload_client import WorkloadClient

    console.print(f"[bold]cubeaccel sandbox exec {sid} -- sh -c '<list PCI functions 1234:11e8 from sysfs>'[/bold]")
    wl = WorkloadClient.over(f"{cubelet_url.rstrip('/')}/v1/sandboxes/{sid}/workload", token, timeout=60)
    out: list[bytes] = []
    try:
        t0 = time.monotonic()
        result = wl.exec(["/bin/sh", "-c", GUEST_DEVICE_SCRIPT], on_stdout=out.append, on_stderr=out.append)
        took = time.monotonic() - t0
    except (CubeError, OSError) as e:
        console.print(f"[red]exec in the guest failed[/red]: {e}")
        return
    finally:
        wl.close()
    text = b"".join(out).decode(errors="replace").rstrip()
    console.print(
        f"[green]in the guest[/green] (exit {result.exit_code}, {took * 1000:.0f} ms):\n{text or '(nothing)'}"
    )


def run_demo(profile: str) -> int:
    """`cubeaccel up` (embedded CubeMaster + one Cubelet, best backend here), one sandbox created through
    CubeMaster, then deleted; the device table, the timeline and the event trail come from Cubelet."""
    from cubeaccel.transport.master_client import MasterClient

    state = Path(tempfile.mkdtemp(prefix="cubeaccel-demo-"))
    up = subprocess.run(
        [sys.executable, "-m", "cubeaccel", "up", "--detach", "--state-dir", str(state), "--profile", profile],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=600,
    )
    if up.returncode != 0:
        console.print(f"[red]cubeaccel up failed[/red] (exit {up.returncode}); logs in {state}")
        return 1
    info = json.loads((state / "up.json").read_text())
    tenant_key = (state / "default.key").read_text().strip()  # the default tenant's key `up` wrote (0600)
    master = MasterClient(info["master_url"], key=tenant_key)
    cubelet = CubeletClient(socket=state / "cubelet" / "cubelet.sock")  # local operator view
    emulated = info["backend"] == "emulated"
    try:
        request = {"gpu": "accelerator:1"} if emulated else {"gpu": "H100:1"}
        console.print(f"[bold]cubeaccel sandbox create --gpu {request['gpu']}[/bold]")
        sb = master.create(request)
        sid = sb.id
        dev = sb.device_ids[0]
        console.print(
            f"placed on node {sb.node} with template {sb.template.name if sb.template else '-'}: device {dev}"
        )

        def ready() -> bool:
            kinds = [e.event or e.kind for e in _events(cubelet, sid)]
            return _has(cubelet, dev, DeviceState.ATTACHED) and ("guest_checked" in kinds or not emulated)

        wait_for(ready, "the sandbox to run with its device attached and validated", 180)
        console.print(_table(cubelet.devices(), title=f"sandbox {sid} running"))
        if emulated and sb.access_token:
            show_device_in_guest(info["cubelet_url"], sid, sb.access_token)
        console.print(f"[bold]cubeaccel sandbox delete {sid}[/bold]")
        master.delete(sid)
        # Its own device: `up` keeps a warm sandbox, whose device stays attached (docs/warm.md).
        wait_for(lambda: _has(cubelet, dev, DeviceState.ALLOCATABLE), "the release", 120)
        wait_for(
            lambda: any(e.kind == EventKind.RESERVATION_CLOSED for e in _events(cubelet, sid)),
            "the reservation to close (shim and VMM gone)",
            60,
        )
        console.print(_table(cubelet.devices(), title="after release (VMM gone, no holders, reset, revalidated)"))
        print_timeline(_events(cubelet, sid))
        trail = [e.model_dump(mode="json") for e in cubelet.events(0, 10000).events]
        console.print(event_table(trail, title="event trail (Cubelet journal)"))
        return 0
    finally:
        subprocess.run([sys.executable, "-m", "cubeaccel", "down", "--state-dir", str(state)], timeout=60)
        cubelet.close()
