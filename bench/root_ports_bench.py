"""What empty root ports cost a MicroVM: cold boot and template restore to agent ready with 4 vs 16 ports.

Every port is a hot-plug slot, so the port count bounds the devices one sandbox can hold (wire/shim_spec.py
MAX_DEVICES). Runs are interleaved (4, 16, 4, 16, ...) so a change in the machine's load hits both; each run
ends with an edu hot-plugged into the *last* port and seen by the guest, so a port the firmware or kernel could
not configure fails the run instead of looking cheap. Prints min/median/max per shape and one JSON line.

Run: .venv/bin/python bench/root_ports_bench.py [--runs 3] [--ports 4,16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from cubeaccel.host.vmm.hypervisor import detect_accel
from cubeaccel.images.builder import build
from cubeaccel.shim.qemu import SOCKETS, VmmFds, _listen, build_argv
from cubeaccel.shim.template import prepare_template
from cubeaccel.shim.vmm import VmConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shim_bench import Raw


def restore(qmp: Raw, state: Path) -> None:
    fd = os.open(state, os.O_RDONLY)
    socket.send_fds(qmp.s, [json.dumps({"execute": "getfd", "arguments": {"fdname": "m"}}).encode()], [fd])
    os.close(fd)
    qmp.until(lambda m: "return" in m)
    qmp.send({"execute": "migrate-incoming", "arguments": {"uri": "fd:m"}})
    qmp.until(lambda m: "return" in m)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        qmp.send({"execute": "query-status"})
        if qmp.until(lambda m: "return" in m)["return"]["status"] in ("paused", "postmigrate"):
            break
        time.sleep(0.005)
    qmp.send({"execute": "cont"})
    qmp.until(lambda m: "return" in m)


def run(cfg: VmConfig, accel: str, state: Path | None) -> dict[str, float]:
    """Spawn → (restore) → agent answers; then edu into the last port until the guest lists it."""
    shutil.rmtree(cfg.state_dir, ignore_errors=True)
    cfg.state_dir.mkdir(parents=True)
    t0 = time.monotonic()
    listeners = [_listen(cfg.state_dir / name) for name in SOCKETS]
    console = os.open(cfg.state_dir / "console.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    qmp_fd, aux_fd, agent_fd, workload_fd = (s.fileno() for s in listeners)
    fds = VmmFds(qmp_fd, aux_fd, agent_fd, workload_fd, console)
    argv = build_argv(cfg, accel, incoming=state is not None, fds=fds)
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, pass_fds=fds.all()
    )
    for s in listeners:
        s.close()
    os.close(console)
    try:
        qmp = Raw(cfg.state_dir / "qmp.sock", t0 + 60)
        qmp.recv()
        qmp.send({"execute": "qmp_capabilities"})
        qmp.until(lambda m: "return" in m)
        if state is not None:
            restore(qmp, state)
        agent = Raw(cfg.state_dir / "agent.sock", t0 + 120)
        agent.send({"v": 1, "id": 1, "method": "hello"})
        agent.until(lambda m: m.get("id") == 1, 120)
        ready = time.monotonic() - t0
        bus = f"rp{cfg.root_ports}"
        qmp.send({"execute": "device_add", "arguments": {"driver": "edu", "id": "last", "bus": bus}})
        reply = qmp.until(lambda m: "return" in m or "error" in m)
        if "error" in reply:
            raise RuntimeError(f"device_add into {bus}: {reply['error']}")
        deadline, i = time.monotonic() + 30, 2
        while True:
            agent.send({"v": 1, "id": i, "method": "probe", "params": {"contract": {"probes": {}}}})
            r = agent.until(lambda m, i=i: m.get("id") == i)
            if any(d.get("device_id") == "11e8" for d in r["result"]["report"]["pci_devices"]):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"edu in {bus} never seen by the guest")
            i += 1
        qmp.send({"execute": "quit"})
        proc.wait(30)
        return {"to_agent_s": ready}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stats(xs: list[float]) -> dict[str, float]:
    return {"min": round(min(xs), 3), "median": round(statistics.median(xs), 3), "max": round(max(xs), 3)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ports", default="4,16")
    args = ap.parse_args()
    if shutil.which("qemu-system-x86_64") is None:
        print(json.dumps({"bench": "root_ports", "skipped": "qemu-system-x86_64 missing"}))
        return 0
    manifest, _ = build()
    accel, _why = detect_accel()
    ports = [int(p) for p in args.ports.split(",")]
    out: dict[str, Any] = {"bench": "root_ports", "accel": accel, "runs": args.runs}
    with tempfile.TemporaryDirectory() as work_s:
        work = Path(work_s)
        cfgs = {
            n: VmConfig(
                sandbox_id=f"bench-ports-{n}",
                memory_mib=256,
                vcpus=1,
                pin_memory=False,
                kernel=manifest.path(manifest.vmlinux),
                initrd=manifest.path(manifest.initrd),
                cmdline=manifest.cmdline,
                state_dir=work / f"p{n}",
                root_ports=n,
            )
            for n in ports
        }
        states = {
            n: prepare_template(replace(c, state_dir=work / f"t{n}"), manifest, work / "templates")[0]
            for n, c in cfgs.items()
        }
        cold: dict[int, list[float]] = {n: [] for n in ports}
        warm: dict[int, list[float]] = {n: [] for n in ports}
        for _ in range(args.runs):
            for n in ports:
                cold[n].append(run(cfgs[n], accel, None)["to_agent_s"])
                warm[n].append(run(cfgs[n], accel, states[n])["to_agent_s"])
        out["cold_boot_to_agent_s"] = {str(n): stats(cold[n]) for n in ports}
        out["template_restore_to_agent_s"] = {str(n): stats(warm[n]) for n in ports}
        out["state_bytes"] = {str(n): states[n].stat().st_size for n in ports}
    out["load_1min"] = round(os.getloadavg()[0], 2)
    for kind in ("cold_boot_to_agent_s", "template_restore_to_agent_s"):
        for n, s in out[kind].items():
            print(f"{kind:<30} {n:>3} ports: min {s['min']:.3f}  median {s['median']:.3f}  max {s['max']:.3f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
