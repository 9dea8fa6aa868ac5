"""CubeShim benchmark: per-phase cycle times for cold and template starts, beside a minimal raw-QMP driver.

Each cycle: spawn → prealloc+lock → boot (or restore) to agent ready → hot-plug edu → guest sees it → detach
(DEVICE_DELETED) → VMM exit. "ours" is the shim as Cubelet starts it: forked from the shim fork server (a
separate process, reporting to a file); the template path also runs it spawned (`python -m cubeaccel.shim run`,
the fallback) for comparison. "raw" is the same VM and the same steps driven by ~60 lines of socket code below,
in this process (unconfined: it runs QEMU directly). The overhead ratio is ours/raw of the median whole cycle.
Then prealloc+lock cost per GiB (1, 2, 4 GiB) beside a plain memset of the same size. Prints a table and one
JSON line.

Run: .venv/bin/python bench/shim_bench.py [--cycles 5] [--sizes 1,2,4]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cubeaccel.cubelet.shim_forkserver import ForkServer
from cubeaccel.host.vmm.hypervisor import detect_accel
from cubeaccel.images.builder import build, cache_dir
from cubeaccel.shim.memory import status_kib
from cubeaccel.shim.qemu import SOCKETS, VmmFds, _listen, build_argv
from cubeaccel.shim.template import prepare_template
from cubeaccel.shim.vmm import VmConfig

PHASES = ("spawn_to_qmp_s", "boot_or_restore_to_agent_s", "hotplug_to_visible_s", "detach_s", "vmm_exit_s")


class Raw:
    """Line-oriented unix-socket client with its own buffer (raw QMP / raw agent)."""

    def __init__(self, path: Path, deadline: float) -> None:
        while True:
            try:
                self.s = socket.socket(socket.AF_UNIX)
                self.s.connect(str(path))
                break
            except OSError:
                self.s.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)
        self.buf = b""

    def send(self, obj: dict[str, Any]) -> None:
        self.s.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self, timeout: float = 60.0) -> dict[str, Any]:
        self.s.settimeout(timeout)
        while b"\n" not in self.buf:
            self.buf += self.s.recv(65536)
        line, self.buf = self.buf.split(b"\n", 1)
        return dict(json.loads(line))

    def until(self, pred: Any, timeout: float = 60.0) -> dict[str, Any]:
        while True:
            msg = self.recv(timeout)
            if pred(msg):
                return msg


def raw_cycle(cfg: VmConfig, accel: str, restore: Path | None) -> dict[str, float]:
    """The same cycle with nothing but sockets: our baseline."""
    t: dict[str, float] = {}
    t0 = time.monotonic()
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    # The VMM gets its listening sockets and console log as descriptors (it opens no file), as the shim does.
    listeners = [_listen(cfg.state_dir / name) for name in SOCKETS]
    console = os.open(cfg.state_dir / "console.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    qmp_fd, aux_fd, agent_fd, workload_fd = (s.fileno() for s in listeners)
    fds = VmmFds(qmp_fd, aux_fd, agent_fd, workload_fd, console)
    proc = subprocess.Popen(
        build_argv(cfg, accel, incoming=restore is not None, fds=fds),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        pass_fds=fds.all(),
    )
    for s in listeners:
        s.close()
    os.close(console)
    try:
        qmp = Raw(cfg.state_dir / "qmp.sock", t0 + 60)
        qmp.recv()
        qmp.send({"execute": "qmp_capabilities"})
        qmp.until(lambda m: "return" in m)
        t["spawn_to_qmp_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        if restore is not None:
            # -sandbox spawn=deny rules out `exec:`; the state file goes over as a descriptor, as the shim does.
            fd = os.open(restore, os.O_RDONLY)
            socket.send_fds(qmp.s, [json.dumps({"execute": "getfd", "arguments": {"fdname": "m"}}).encode()], [fd])
            os.close(fd)
            qmp.until(lambda m: "return" in m)
            qmp.send({"execute": "migrate-incoming", "arguments": {"uri": "fd:m"}})
            qmp.until(
                lambda m: (
                    m.get("event") == "RESUME"
                    or ("data" in m and m["data"].get("status") == "completed")
                    or "return" in m
                )
            )
            while True:
                qmp.send({"execute": "query-status"})
                st = qmp.until(lambda m: "return" in m)["return"]["status"]
                if st in ("paused", "postmigrate"):
                    break
                time.sleep(0.005)
            qmp.send({"execute": "cont"})
            qmp.until(lambda m: "return" in m)
        agent = Raw(cfg.state_dir / "agent.sock", t1 + 60)
        agent.send({"v": 1, "id": 1, "method": "hello"})
        agent.until(lambda m: m.get("id") == 1)
        t["boot_or_restore_to_agent_s"] = time.monotonic() - t1
        t2 = time.monotonic()
        qmp.send({"execute": "device_add", "arguments": {"driver": "edu", "id": "accel0", "bus": "rp1"}})
        qmp.until(lambda m: "return" in m or "error" in m)
        i = 2
        while True:
            agent.send(
                {"v": 1, "id": i, "method": "probe", "params": {"contract": {"probes": {}}, "load_modules": False}}
            )
            r = agent.until(lambda m, i=i: m.get("id") == i)
            if any(
                d.get("vendor_id") == "1234" and d.get("device_id") == "11e8"
                for d in r["result"]["report"]["pci_devices"]
            ):
                break
            i += 1
        t["hotplug_to_visible_s"] = time.monotonic() - t2
        t3 = time.monotonic()
        qmp.send({"execute": "device_del", "arguments": {"id": "accel0"}})
        qmp.until(lambda m: m.get("event") == "DEVICE_DELETED" and m.get("data", {}).get("device") == "accel0")
        t["detach_s"] = time.monotonic() - t3
        t4 = time.monotonic()
        qmp.send({"execute": "quit"})
        proc.wait(30)
        t["vmm_exit_s"] = time.monotonic() - t4
        t["cycle_s"] = time.monotonic() - t0
        return t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def our_cycle(manifest_path: Path, work: Path, start: str, n: int, forks: ForkServer | None) -> dict[str, float]:
    sandbox = f"bench-{start}-{n}-{'fork' if forks else 'spawn'}"
    sd = work / sandbox
    spec = {
        "sandbox_id": sandbox,
        "devices": [
            {
                "device_id": "emulated-0000:e0:00.0",
                "driver": "edu",
                "properties": {},
                "vendor_id": "1234",
                "device_id_hex": "11e8",
            }
        ],
        "memory_mib": 256,
        "vcpus": 1,
        "pin_memory": True,
        "contract": None,
        "image_manifest": str(manifest_path),
        "start": start,
        "state_dir": str(sd / "state"),
        "report": {"file": str(sd / "reports.jsonl")},
        "detach_timeout_s": 10,
    }
    sd.mkdir(parents=True)
    (sd / "spec.json").write_text(json.dumps(spec))
    argv = [sys.executable, "-m", "cubeaccel.shim", "run", "--sandbox", sandbox, "--spec", str(sd / "spec.json")]
    t0 = time.monotonic()
    if forks is None:  # spawned, as Cubelet did before the fork server (and still does when it is unavailable)
        proc = subprocess.Popen(argv)
        pid = proc.pid
    else:
        with open(sd / "shim.log", "ab") as log:
            forked = forks.launch(argv, log.fileno(), None)
        if forked is None:
            raise RuntimeError(f"fork server refused: {forks.last_refusal}")
        pid = forked
    exited = os.pidfd_open(pid)
    reports = sd / "reports.jsonl"
    attached_at = None
    while not select.select([exited], [], [], 0.005)[0] and attached_at is None:
        if reports.exists() and '"device_attached"' in reports.read_text():
            attached_at = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    select.select([exited], [], [], 60)
    os.close(exited)
    if forks is None:
        proc.wait(60)
    total = time.monotonic() - t0
    lines = [json.loads(x) for x in reports.read_text().splitlines()]
    tl = lines[-1]["details"]["timeline"]
    if "device_attached" not in [x["kind"] for x in lines]:
        raise RuntimeError(f"cycle failed: {[x['kind'] for x in lines]}")
    return {
        "spawn_to_qmp_s": tl["spawn_to_qmp_s"],
        "boot_or_restore_to_agent_s": tl.get("boot_to_agent_s", tl.get("restore_to_agent_s", 0.0))
        + tl.get("restore_s", 0.0),
        "hotplug_to_visible_s": tl["hotplug_to_visible_s"],
        "detach_s": tl["detach_s"],
        "vmm_exit_s": tl["vmm_exit_s"],
        "cycle_s": total,
    }


def memory_cost(gib: int) -> dict[str, float]:
    """Seconds for QEMU to preallocate + lock `gib` (until QMP answers and VmLck covers it) vs a memset."""
    with tempfile.TemporaryDirectory() as d:
        sock = Path(d) / "qmp.sock"
        accel = detect_accel()[0]
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [
                "qemu-system-x86_64",
                "-S",
                "-nodefaults",
                "-display",
                "none",
                "-machine",
                "q35,memory-backend=m0",
                "-accel",
                "tcg,tb-size=64" if accel == "tcg" else "kvm",
                "-m",
                f"{gib}G",
                "-object",
                f"memory-backend-ram,id=m0,size={gib}G,prealloc=on",
                "-overcommit",
                "mem-lock=on",
                "-qmp",
                f"unix:{sock},server=on,wait=off",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while status_kib(proc.pid).get("VmLck", 0) < gib << 20 or not sock.exists():
                if proc.poll() is not None:
                    raise RuntimeError("qemu exited (memlock?)")
                time.sleep(0.002)
            lock_s = time.monotonic() - t0
        finally:
            proc.kill()
            proc.wait()
    n = gib << 30
    t1 = time.monotonic()
    buf = mmap.mmap(-1, n)
    ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(buf)), 1, n)
    memset_s = time.monotonic() - t1
    del buf
    return {
        "gib": gib,
        "prealloc_lock_s": lock_s,
        "memset_s": memset_s,
        "prealloc_lock_s_per_gib": lock_s / gib,
        "memset_s_per_gib": memset_s / gib,
    }


def med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--sizes", default="1,2,4")
    args = ap.parse_args()
    if shutil.which("qemu-system-x86_64") is None:
        print(json.dumps({"bench": "shim", "skipped": "qemu-system-x86_64 missing"}))
        return 0
    manifest, _ = build()
    mpath = manifest.directory / "manifest.json"
    accel, why = detect_accel()
    result: dict[str, Any] = {"bench": "shim", "accel": accel, "accel_reason": why, "cycles": args.cycles}
    with tempfile.TemporaryDirectory() as work_s:
        work = Path(work_s)
        base = VmConfig(
            sandbox_id="bench-raw",
            memory_mib=256,
            vcpus=1,
            pin_memory=True,
            kernel=manifest.path(manifest.vmlinux),
            initrd=manifest.path(manifest.initrd),
            cmdline=manifest.cmdline,
            state_dir=work / "raw",
        )
        state, _ = prepare_template(base, manifest, cache_dir() / "templates")
        forks = ForkServer(work, sys.executable)  # how Cubelet starts shims: forked from a pre-started server
        forks.ensure_started()
        deadline = time.monotonic() + 60
        while not forks.socket.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        for start in ("cold", "template"):
            ours, spawned, raw = [], [], []
            for n in range(args.cycles):  # interleaved, so a change in the machine's load hits every path
                ours.append(our_cycle(mpath, work, start, n, forks))
                if start == "template":
                    spawned.append(our_cycle(mpath, work, start, n, None))
                shutil.rmtree(work / "raw", ignore_errors=True)
                raw.append(raw_cycle(base, accel, state if start == "template" else None))
            result[start] = {
                "ours_median": {k: round(med(ours, k), 4) for k in (*PHASES, "cycle_s")},
                "raw_median": {k: round(med(raw, k), 4) for k in (*PHASES, "cycle_s")},
                "overhead_ratio": round(med(ours, "cycle_s") / med(raw, "cycle_s"), 3),
                "ratios": [round(o["cycle_s"] / r["cycle_s"], 3) for o, r in zip(ours, raw, strict=True)],
            }
            if spawned:
                result[start]["spawned_median"] = {k: round(med(spawned, k), 4) for k in (*PHASES, "cycle_s")}
                result[start]["spawned_ratio"] = round(med(spawned, "cycle_s") / med(raw, "cycle_s"), 3)
        forks.close()
        result["load_1min"] = os.getloadavg()[0]
    result["memory"] = [{k: round(v, 4) for k, v in memory_cost(int(g)).items()} for g in args.sizes.split(",")]
    print(f"accel: {accel} ({why})")
    print(f"{'phase (median s)':<28}" + "".join(f"{c:>14}" for c in ("cold ours", "cold raw", "tmpl ours", "tmpl raw")))
    for k in (*PHASES, "cycle_s"):
        print(
            f"{k:<28}"
            + "".join(f"{result[s][w][k]:>14.3f}" for s in ("cold", "template") for w in ("ours_median", "raw_median"))
        )
    print(
        f"overhead ratio (ours/raw whole cycle): cold {result['cold']['overhead_ratio']}, "
        f"template {result['template']['overhead_ratio']} (per cycle {result['template']['ratios']}); "
        f"template spawned instead of forked: {result['template']['spawned_ratio']}; load {result['load_1min']:.1f}"
    )
    for m in result["memory"]:
        print(
            f"{m['gib']} GiB: prealloc+lock {m['prealloc_lock_s']:.3f} s ({m['prealloc_lock_s_per_gib']:.3f} s/GiB)"
            f"  memset {m['memset_s']:.3f} s ({m['memset_s_per_gib']:.3f} s/GiB)"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
