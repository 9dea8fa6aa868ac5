"""The confined VMM, read from /proc on real QEMU: its own uid, no capabilities beyond the one the host forces,
seccomp filtering, a mount namespace holding only what the shim exposed — and another sandbox's files out of
reach. A VMM that does not verify is refused before any hot-plug, and through Cubelet its device is released."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.host.vmm.confine import CAP_IPC_LOCK, ConfinePolicy
from cubeaccel.images.manifest import Manifest
from cubeaccel.wire.cubelet_api import Event
from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms

pytestmark = pytest.mark.vm


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _mount_points(pid: int) -> set[str]:
    return {line.split()[4] for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()}


def test_vmm_runs_as_its_own_uid_without_capabilities_under_seccomp(shim_factory: Any, guest_image: Manifest) -> None:
    run = shim_factory(start="template").start()
    run.wait_for("device_attached")
    pid = run.one("vm_started")["details"]["pid"]
    proof = run.one("vmm_confined")["details"]
    kinds = run.kinds()
    assert kinds.index("vmm_confined") < kinds.index("guest_ready") < kinds.index("device_attached")

    st = _status(pid)  # read here, not taken from the report
    uid = proof["uid"]
    assert uid in ConfinePolicy.from_env().uids and uid != os.getuid()
    assert st["Uid"].split() == [str(uid)] * 4 and st["Gid"].split() == [str(uid)] * 4
    assert st["Groups"] == ""
    # These hosts cannot raise RLIMIT_MEMLOCK for a child (no CAP_SYS_RESOURCE): then exactly CAP_IPC_LOCK.
    want = {"rlimit": 0, "cap_ipc_lock": 1 << CAP_IPC_LOCK}[proof["memlock_mode"]]
    for key in ("CapEff", "CapPrm", "CapBnd"):
        assert int(st[key], 16) == want, (key, st[key])
    assert st["Seccomp"] == "2" and st["NoNewPrivs"] == "1"
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    assert Path(f"/proc/{pid}/limits").read_text().count("Max core file size        0")

    mounts = _mount_points(pid)  # only QEMU itself, the guest's kernel and initrd, and three device nodes
    assert mounts == {
        "/",
        "/dev",
        "/usr",
        str(guest_image.path(guest_image.vmlinux)),
        str(guest_image.path(guest_image.initrd)),
        "/dev/null",
        "/dev/zero",
        "/dev/urandom",
    }
    assert run.terminate() == 0
    assert run.kinds()[-2:] == ["vmm_exited", "shim_exiting"]


def _as_vmm(pid: int, uid: int, *cmd: str, namespace: bool) -> subprocess.CompletedProcess[str]:
    """Run `cmd` with the VMM's credentials (uid, gid, no groups, no capabilities) — in its mount namespace or
    in the host's."""
    drop = [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]
    enter = ["nsenter", f"--target={pid}", "--mount", "--"] if namespace else []
    return subprocess.run([*enter, *drop, *cmd], capture_output=True, text=True, timeout=30)


PROBE = """
import os, socket, sys
for path in sys.argv[1:]:
    try:
        if path.endswith(".sock"):
            s = socket.socket(socket.AF_UNIX); s.connect(path); print("OPEN", path)
        else:
            open(path, "rb").close(); print("OPEN", path)
    except OSError as e:
        print(type(e).__name__, path)
"""


def test_a_vmm_cannot_open_another_sandboxs_files(shim_factory: Any) -> None:
    a = shim_factory(start="template").start()
    b = shim_factory(start="template").start()
    a.wait_for("guest_ready")
    b.wait_for("guest_ready")
    a_pid, a_uid = a.one("vm_started")["details"]["pid"], a.one("vmm_confined")["details"]["uid"]
    b_pid, b_uid = b.one("vm_started")["details"]["pid"], b.one("vmm_confined")["details"]["uid"]
    assert a_uid != b_uid  # one uid per sandbox: neither can signal, trace or own what the other has

    theirs = [str(b.state_dir / n) for n in ("console.log", "vmm.log", "qmp.sock", "qmp-aux.sock", "agent.sock")]
    theirs += [str(b.spec_path), f"/proc/{b_pid}/environ"]
    ours = [str(a.state_dir / "console.log"), str(a.state_dir / "qmp-aux.sock")]
    python = "/usr/bin/python3"  # inside the VMM's namespace only /usr exists
    # In its own namespace none of them exists at all, not even its own sandbox's files.
    inside = _as_vmm(a_pid, a_uid, python, "-I", "-c", PROBE, *theirs, *ours, namespace=True)
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.split("\n")[:-1] == [f"FileNotFoundError {p}" for p in [*theirs, *ours]]
    # And should it reach the host's tree, its uid still could not open them (root's, owner-only) nor signal B.
    outside = _as_vmm(a_pid, a_uid, python, "-I", "-c", PROBE, *theirs, namespace=False)
    assert outside.returncode == 0, outside.stderr
    assert all(line.startswith("PermissionError") for line in outside.stdout.split("\n")[:-1]), outside.stdout
    kill = _as_vmm(a_pid, a_uid, "kill", "-0", str(b_pid), namespace=False)
    assert kill.returncode != 0 and Path(f"/proc/{b_pid}").exists()
    assert a.terminate() == 0 and b.terminate() == 0


def test_a_vmm_failing_verification_is_refused_before_any_hotplug(
    shim_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBEACCEL_VMM_CONFINE_FAULT", "wrong_uid")  # verification expects another uid
    run = shim_factory(start="cold").start()  # cold: a template VM would be refused the same way, first
    run.wait_for("shim_exiting")
    assert run.proc.wait(30) == 1
    failed = run.one("attach_failed")["details"]
    assert failed["reason"] == "vmm.not_confined" and failed["layer"] == "backend"
    assert any(p.startswith("uid ") for p in failed["problems"])
    assert "vmm_confined" not in run.kinds() and "device_attached" not in run.kinds()
    assert run.kinds()[-2:] == ["vmm_exited", "shim_exiting"]


def test_refused_start_through_cubelet_releases_the_device(
    tmp_path: Path, guest_image: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBEACCEL_VMM_CONFINE_FAULT", "wrong_uid")  # inherited by Cubelet and its shims
    # Cold: the refusal comes right after the VMM started, before any guest boots (no template to build).
    node = CubeletProcess(
        # no scrub VM: it would inherit the injected fault too (the scrub's own faults: test_scrub_between_tenants)
        tmp_path,
        "-",
        "--backend",
        "emulated",
        "--release-timeout",
        "5",
        "--vm-start",
        "cold",
        "--scrub",
        "accelerator=none",
    ).start()
    try:
        dev = node.client.reserve("f-unconfined", 1, memory_mib=256, start=True).devices[0].id

        def events() -> list[Event]:
            return [e for e in node.client.events(0, 10000).events if e.sandbox_id == "f-unconfined"]

        poll(lambda: any(e.kind == "reservation_closed" for e in events()), 120)
        device = next(d for d in node.client.devices() if d.id == dev)
        assert device.state == "allocatable"  # through the release path: VMM gone, reset, revalidated
        kinds = [e.event or e.kind for e in events()]
        assert kinds.index("teardown_started") < kinds.index("release_confirmed") < kinds.index("revalidated")
        started = next(e for e in events() if e.kind == "teardown_started")
        assert started.reason == "vmm.not_confined"
        shim = [e.event for e in events() if e.kind == "shim_report"]
        assert "device_attached" not in shim and "vmm_confined" not in shim
    finally:
        node.stop()
        kill_started_vmms(tmp_path)
