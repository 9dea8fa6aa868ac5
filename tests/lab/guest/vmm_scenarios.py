"""A VMM that really holds the device: the host's QEMU, copied into the lab guest (/opt/qemu), opens it via VFIO.

The L2 guest never runs (`-S`): opening the device (container, group, device fd, all guest RAM mapped and pinned
for DMA) happens at startup or on QMP `device_add`, which is what the release rules must see.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from scenarios import MF0, MF1, RP, backend, enable_count, ensure_vfio, fn, holders, host, ms_since, problems, record

from cubeaccel.model.device import PciAddress
from cubeaccel.model.states import DeviceState

QEMU_HOME = "/opt/qemu"
ENV = {"LD_LIBRARY_PATH": f"{QEMU_HOME}/lib", "QEMU_MODULE_DIR": f"{QEMU_HOME}/modules", "PATH": "/bin:/usr/bin"}
GUEST_MIB = 64


class Qmp:
    """Just enough QMP: one command at a time, events skipped, a deadline on every read."""

    def __init__(self, path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.settimeout(timeout_s)
                self.sock.connect(path)
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.buf = b""
        self.events: list[dict[str, Any]] = []
        self._read()  # greeting
        self.cmd("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise OSError("QMP closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        return msg

    def wait_event(self, name: str, timeout_s: float) -> dict[str, Any] | None:
        """The first `name` event (already buffered or arriving) within `timeout_s`, else None."""
        end = time.monotonic() + timeout_s
        for ev in self.events:
            if ev.get("event") == name:
                return ev
        while time.monotonic() < end:
            self.sock.settimeout(max(0.05, end - time.monotonic()))
            try:
                msg = self._read()
            except TimeoutError:
                break
            if msg.get("event") == name:
                return msg
        return None

    def cmd(self, name: str, **args: Any) -> dict[str, Any]:
        self.sock.sendall(json.dumps({"execute": name, "arguments": args}).encode() + b"\n")
        while True:
            msg = self._read()
            if "return" in msg or "error" in msg:
                return msg
            self.events.append(msg)

    def close(self) -> None:
        self.sock.close()


@dataclass
class Vmm:
    proc: subprocess.Popen[bytes]
    qmp: Qmp | None
    started_s: float

    @property
    def pid(self) -> int:
        return self.proc.pid

    def quit(self, timeout_s: float = 20.0) -> int:
        if self.qmp is not None:
            with contextlib.suppress(OSError):
                self.qmp.cmd("quit")
            self.qmp.close()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_vmm(name: str, devices: list[PciAddress], qmp: bool = True, qmp_dir: str = "/tmp") -> Vmm:
    sock = f"{qmp_dir}/{name}.qmp"
    args = [
        f"{QEMU_HOME}/bin/qemu-system-x86_64", "-L", f"{QEMU_HOME}/share",
        "-name", f"guest=cubeaccel-sandbox={name}", "-nodefaults", "-no-user-config", "-display", "none",
        "-machine", "q35", "-accel", "tcg,tb-size=16", "-m", str(GUEST_MIB), "-S",
        "-device", "pcie-root-port,id=rp1,chassis=1,slot=1",
    ]  # fmt: skip
    if qmp:
        args += ["-qmp", f"unix:{sock},server=on,wait=off"]
    for i, a in enumerate(devices):
        args += ["-device", f"vfio-pci,host={a},bus=rp1,id=gpu{i}" if i == 0 else f"vfio-pci,host={a},id=gpu{i}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = None
    if qmp:
        try:
            client = Qmp(sock, 30.0)
        except OSError:
            proc.kill()
            _out, err = proc.communicate()
            raise OSError(f"QEMU did not come up: {err.decode(errors='replace')[-800:]}") from None
    return Vmm(proc, client, time.monotonic() - t0)


def locked_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmLck", "VmPin", "VmRSS"):
                out[key] = int(value.split()[0])
    return out


def refused_open(address: PciAddress) -> dict[str, Any]:
    """A second VMM asking for the same device: it must fail, and say why."""
    t0 = time.monotonic()
    other = start_vmm("lab-second", [address], qmp=False)
    try:
        _out, err = other.proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        other.proc.kill()
        _out, err = other.proc.communicate()
    return {"rc": other.proc.returncode, "stderr": err.decode(errors="replace")[-600:], "ms": ms_since(t0)}


def _release(address: PciAddress, vmm: Vmm) -> dict[str, Any]:
    """The release rules' order with a real VMM: blocked while it lives, released after it exits, reset, revalidate."""
    out: dict[str, Any] = {"while_alive": problems(backend.wait_released(record(address), 0.2))}
    t0 = time.monotonic()
    out["rc"] = vmm.quit()
    out["exit_ms"] = ms_since(t0)
    t1 = time.monotonic()
    out["wait_released"] = problems(backend.wait_released(record(address), 10.0))
    out["released_ms"] = ms_since(t1)
    out["holders_after"] = holders(address)
    t2 = time.monotonic()
    out["cleanup"] = problems(backend.cleanup(record(address, DeviceState.RELEASING)))
    out["cleanup_ms"] = ms_since(t2)
    out["validate"] = problems(backend.validate(record(address)))
    out["cycle_ms"] = ms_since(t0)
    return out


def vmm_paused() -> dict[str, Any]:
    ensure_vfio(RP)
    t0 = time.monotonic()
    vmm = start_vmm("lab-paused", [RP])
    out: dict[str, Any] = {"qmp_ready_s": round(vmm.started_s, 3), "vmm_pid": vmm.pid}
    try:
        out["holders"] = holders(RP)
        out["status"] = vmm.qmp.cmd("query-status") if vmm.qmp else {}
        out["memory"] = locked_kib(vmm.pid)
        out["validate"] = problems(backend.validate(record(RP)))
        out["health_attached"] = problems(backend.health(record(RP, DeviceState.ATTACHED)))
        out["health_allocatable"] = problems(backend.health(record(RP)))
        out["second_vmm"] = refused_open(RP)
        out["holders_after_refusal"] = holders(RP)
    finally:
        out["release"] = _release(RP, vmm)
    out["total_ms"] = ms_since(t0)
    return out


def vmm_hotplug() -> dict[str, Any]:
    ensure_vfio(RP)
    vmm = start_vmm("lab-hotplug", [])
    out: dict[str, Any] = {"qmp_ready_s": round(vmm.started_s, 3), "vmm_pid": vmm.pid}
    try:
        assert vmm.qmp is not None
        out["holders_before"] = holders(RP)
        t0 = time.monotonic()
        out["device_add"] = vmm.qmp.cmd("device_add", driver="vfio-pci", host=str(RP), bus="rp1", id="gpu0")
        out["device_add_ms"] = ms_since(t0)
        out["holders"] = holders(RP)
        out["enable"] = enable_count(RP)
        out["memory"] = locked_kib(vmm.pid)
    finally:
        out["release"] = _release(RP, vmm)
    return out


def vmm_group_not_viable() -> dict[str, Any]:
    """QEMU and cubeaccel agree: a group with a member on another driver cannot be opened."""
    ensure_vfio(MF0, MF1)
    host.bind(MF1, "uio_pci_generic")
    try:
        out: dict[str, Any] = {"validate": problems(backend.validate(record(MF0))), "vmm": refused_open(MF0)}
    finally:
        ensure_vfio(MF1)
    out["group"] = fn(MF0).iommu_group
    return out


def vmm_cycles() -> dict[str, Any]:
    """Repeated open → quit → released → reset → validate cycles, for timings."""
    ensure_vfio(RP)
    cycles = []
    for i in range(3):
        t0 = time.monotonic()
        vmm = start_vmm(f"lab-cycle{i}", [RP])
        seen = [h["pid"] for h in holders(RP)] == [vmm.pid]
        rel = _release(RP, vmm)
        ok = not (rel["wait_released"] or rel["cleanup"] or rel["validate"])
        cycles.append({"holder_seen": seen, "ok": ok, "cycle_ms": ms_since(t0), "qmp_ready_s": round(vmm.started_s, 3)})
    return {"cycles": cycles}


SCENARIOS = {f.__name__: f for f in (vmm_paused, vmm_hotplug, vmm_group_not_viable, vmm_cycles)}
