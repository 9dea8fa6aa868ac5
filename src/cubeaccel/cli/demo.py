"""`make demo`: a real Cubelet process, one sandbox's reserve → attach → release, device table, event trail."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cubeaccel.cli.render import console, device_table, event_table
from cubeaccel.cubelet.client import CubeletClient
from cubeaccel.model.errors import CubeError


def wait_for_cubelet(client: CubeletClient, proc: subprocess.Popen[bytes], deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"cubelet exited early with {proc.returncode}")
        try:
            client.health()
            return
        except (CubeError, OSError, Exception):
            time.sleep(0.05)
    raise TimeoutError("cubelet did not answer in time")


def run_demo(profile: str) -> int:
    state = Path(tempfile.mkdtemp(prefix="cubeaccel-demo-"))
    cmd = [sys.executable, "-m", "cubeaccel", "cubelet", "serve", "--backend", "simulated", "--profile", profile,
           "--state-dir", str(state)]
    console.print(f"[bold]starting Cubelet[/bold] (simulated backend, profile {profile}) in {state}")
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    client = CubeletClient(socket=state / "cubelet.sock")
    try:
        wait_for_cubelet(client, proc)
        console.print(device_table(client.devices(), title="after host initialization"))
        res = client.reserve("demo-sandbox", 1, template="edu-demo", start=True)
        console.print(device_table(res["devices"], title="sandbox demo-sandbox running"))
        client.release("demo-sandbox")
        console.print(device_table(client.devices(), title="after release"))
        console.print(event_table(client.events()["events"], title="event trail"))
        return 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        client.close()
