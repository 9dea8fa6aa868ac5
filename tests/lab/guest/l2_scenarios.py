"""A second-level guest that uses the passed-through device (the opt-in slow check, tests/lab/test_vfio_lab_l2.py).

L1 (this lab guest) runs QEMU with `-device vfio-pci` on a `-machine pc` guest whose "kernel" is the bare-metal
/lab/l2dma.elf (tests/lab/l2/l2dma.c): it does DMA with the edu through the whole chain, then answers the ACPI
unplug request that QMP `device_del` raises. No L2 Linux: TCG inside TCG boots one in ~400 s.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from scenarios import RP, backend, ensure_vfio, holders, ms_since, problems, record
from vmm_scenarios import ENV, QEMU_HOME, Qmp, Vmm

from cubeaccel.model.states import DeviceState

LOG = Path("/tmp/l2-console.log")


def _wait_line(marker: str, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if LOG.exists() and marker in LOG.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


def l2_dma_unplug() -> dict[str, Any]:
    ensure_vfio(RP)
    sock = "/tmp/lab-l2.qmp"
    args = [
        f"{QEMU_HOME}/bin/qemu-system-x86_64", "-L", f"{QEMU_HOME}/share",
        "-name", "guest=cubeaccel-sandbox=lab-l2", "-nodefaults", "-no-user-config", "-display", "none",
        "-machine", "pc", "-accel", "tcg,tb-size=16", "-m", "64", "-kernel", "/lab/l2dma.elf",
        "-serial", f"file:{LOG}", "-qmp", f"unix:{sock},server=on,wait=off",
        "-device", f"vfio-pci,host={RP},id=gpu0,addr=05.0",
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    vmm = Vmm(proc, Qmp(sock, 60.0), 0.0)
    out: dict[str, Any] = {"qmp_ready_s": round(time.monotonic() - t0, 2)}
    try:
        out["holders_running"] = holders(RP)
        out["dma_done"] = _wait_line("L2 WAITING-UNPLUG", 900.0) or _wait_line("L2 DONE", 1.0)
        out["dma_s"] = round(time.monotonic() - t0, 2)
        assert vmm.qmp is not None
        t1 = time.monotonic()
        out["device_del"] = vmm.qmp.cmd("device_del", id="gpu0")
        out["deleted"] = vmm.qmp.wait_event("DEVICE_DELETED", 120.0)
        out["unplug_ms"] = ms_since(t1)
        out["holders_after_unplug"] = holders(RP)  # the VMM still runs: the release rules still wait for its exit
        out["vmm_alive_after_unplug"] = proc.poll() is None
    finally:
        out["console"] = LOG.read_text(errors="replace")[-2000:] if LOG.exists() else ""
        out["rc"] = vmm.quit()
        out["stderr"] = (proc.stderr.read().decode(errors="replace") if proc.stderr else "")[-1000:]
    out["wait_released"] = problems(backend.wait_released(record(RP), 10.0))
    out["cleanup"] = problems(backend.cleanup(record(RP, DeviceState.RELEASING)))
    out["validate"] = problems(backend.validate(record(RP)))
    out["total_s"] = round(time.monotonic() - t0, 2)
    return out


SCENARIOS = {"l2_dma_unplug": l2_dma_unplug}
