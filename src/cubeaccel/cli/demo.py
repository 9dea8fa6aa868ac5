"""`make demo`: one GPU-style sandbox end to end on a throwaway node, with its cold-start timeline.

Backend: `emulated` (a real QEMU MicroVM hot-plugging the emulated `edu` PCI device) where QEMU is installed
and the guest image builds; otherwise `simulated`, saying why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from cubeaccel.cli.render import console, device_table, event_table
from cubeaccel.cubelet.client import CubeletClient
from cubeaccel.model.errors import CubeError

EDU_TEMPLATE = Path(__file__).resolve().parents[3] / "examples" / "templates" / "edu-demo.yaml"


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


def choose_backend() -> tuple[str, str, dict[str, Any] | None]:
    """("emulated"|"simulated", why, frozen edu-demo contract pinned to the built image or None)."""
    if shutil.which("qemu-system-x86_64") is None:
        return "simulated", "qemu-system-x86_64 is not installed (run `make deps` as root)", None
    from cubeaccel.images.builder import build
    from cubeaccel.model.contract import freeze
    from cubeaccel.model.template_spec import GuestKernel, ModulesImg
    from cubeaccel.shim.vmm import detect_accel
    from cubeaccel.templates import load_template

    try:
        image, fresh = build()
    except CubeError as e:
        return "simulated", f"the guest image could not be built: {e.code}: {e.message}", None
    accel, why = detect_accel()
    t = load_template(EDU_TEMPLATE)
    t = replace(t, guest_image_digest=image.image_digest,
                guest_kernel=GuestKernel(image.kernel_release, image.vmlinux.sha256),
                modules_img=ModulesImg(image.kernel_release, image.modules_img.sha256))
    note = (f"real QEMU MicroVM, accel {accel} ({why}); guest kernel {image.kernel_release}, "
            f"image {'built now' if fresh else 'from cache'}")
    return "emulated", note, freeze(t).to_json()


def _events(client: CubeletClient, sid: str) -> list[dict[str, Any]]:
    return [e for e in client.events(0, 10000)["events"] if e["sandbox_id"] == sid]


def print_timeline(events: list[dict[str, Any]]) -> None:
    if not events:
        return
    t0 = events[0]["at"]
    console.print("[bold]sandbox timeline[/bold] (seconds since the reservation, from Cubelet's event journal)")
    for e in events:
        label = e["event"] or e["kind"]
        if e["kind"] == "transition":
            label = f"{e['device_id']}: {e['from_state']} → {e['to_state']}"
        console.print(f"  {e['at'] - t0:7.3f}s  {label}")
    shim = [e for e in events if e["event"] == "shim_exiting"]
    if shim and shim[-1]["details"].get("timeline"):
        console.print("[bold]shim phase breakdown[/bold] (seconds, measured by the shim)")
        for k, v in shim[-1]["details"]["timeline"].items():
            console.print(f"  {k:<24} {v:8.3f}")


def run_demo(profile: str) -> int:
    backend, why, contract = choose_backend()
    console.print(f"[bold]backend: {backend}[/bold] — {why}")
    state = Path(tempfile.mkdtemp(prefix="cubeaccel-demo-"))
    cmd = [sys.executable, "-m", "cubeaccel", "cubelet", "serve", "--backend", backend, "--profile", profile,
           "--state-dir", str(state), "--tick", "0.5"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL)
    client = CubeletClient(socket=state / "cubelet.sock")
    sid = "demo-sandbox"
    try:
        wait_for(client.health, "Cubelet", 30)
        console.print(device_table(client.devices(), title="after host initialization and reconcile"))
        extra: dict[str, Any] = {"template": "edu-demo" if contract else "h100-simulated", "start": True}
        if contract is not None:
            extra.update(contract=contract)
        body = client.reserve(sid, 1, **extra)
        dev = body["devices"][0]["id"]

        def ready() -> bool:
            kinds = [e["event"] or e["kind"] for e in _events(client, sid)]
            attached = any(d["id"] == dev and d["state"] == "attached" for d in client.devices())
            return attached and ("guest_checked" in kinds or contract is None)

        wait_for(ready, "the sandbox to run with its device attached and validated", 180)
        console.print(device_table(client.devices(), title=f"sandbox {sid} running"))
        client.release(sid)
        wait_for(lambda: all(d["state"] == "allocatable" for d in client.devices()), "the release", 120)
        wait_for(lambda: any(e["event"] == "shim_exiting" for e in _events(client, sid)) or backend != "emulated",
                 "the shim to exit", 30)
        console.print(device_table(client.devices(), title="after release (VMM gone, no holders, reset, revalidated)"))
        print_timeline(_events(client, sid))
        console.print(event_table(client.events(0, 10000)["events"], title="event trail"))
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        client.close()
