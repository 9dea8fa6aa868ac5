"""Shim parts without a VMM: accel choice, the QEMU command line, the VmLck proof, report delivery."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.host.vmm.hypervisor import detect_accel
from cubeaccel.protocol.errors import CubeError
from cubeaccel.shim.memory import prove_pinned, status_kib
from cubeaccel.shim.qemu import SANDBOX_ARG, VmmFds, build_argv
from cubeaccel.shim.reporter import Reporter
from cubeaccel.shim.vmm import VmConfig
from cubeaccel.wire.reports import ShimExiting, VmmExited, VmStarted
from cubeaccel.wire.shim_spec import MAX_DEVICES


def _cfg(tmp_path: Path, pin: bool = True) -> VmConfig:
    return VmConfig(
        sandbox_id="sb-1",
        memory_mib=512,
        vcpus=2,
        pin_memory=pin,
        kernel=tmp_path / "vmlinux",
        initrd=tmp_path / "initrd.img",
        cmdline="console=ttyS0",
        state_dir=tmp_path / "state",
    )


@pytest.fixture(autouse=True)
def _no_forced_accel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBEACCEL_ACCEL", raising=False)
    monkeypatch.setenv("CUBEACCEL_QEMU", "/usr/bin/qemu-system-x86_64")


def test_pvm_kvm_falls_back_to_tcg_and_says_why(tmp_path: Path) -> None:
    dev = tmp_path / "kvm"
    dev.write_text("")
    (tmp_path / "mod" / "kvm_pvm").mkdir(parents=True)
    accel, why = detect_accel(dev, tmp_path / "mod")
    assert accel == "tcg" and "kvm_pvm" in why


def test_hardware_kvm_is_used_and_missing_kvm_is_tcg(tmp_path: Path) -> None:
    dev = tmp_path / "kvm"
    dev.write_text("")
    (tmp_path / "mod" / "kvm_intel").mkdir(parents=True)
    assert detect_accel(dev, tmp_path / "mod")[0] == "kvm"
    assert detect_accel(tmp_path / "absent", tmp_path / "mod") == ("tcg", f"{tmp_path / 'absent'} does not exist")


FDS = VmmFds(qmp=10, qmp_aux=11, agent=12, workload=13, console=14)


def test_command_line_locks_preallocated_memory_and_tags_the_sandbox(tmp_path: Path) -> None:
    argv = build_argv(_cfg(tmp_path), "tcg", fds=FDS)
    joined = " ".join(argv)
    assert argv[1:3] == ["-name", "guest=cubeaccel-sandbox=sb-1"]
    assert "memory-backend-ram,id=m0,size=512M,prealloc=on" in argv
    assert "-overcommit mem-lock=on" in joined and "tcg,tb-size=64" in argv
    assert joined.count("pcie-root-port") == MAX_DEVICES and "pref64-reserve=2G" in joined
    assert "-incoming" not in argv
    assert "-overcommit" not in build_argv(_cfg(tmp_path, pin=False), "tcg", fds=FDS)
    restore = build_argv(_cfg(tmp_path), "tcg", incoming=True, fds=FDS)
    assert restore[:-2] == argv and restore[-2:] == ["-incoming", "defer"]  # same machine as the template
    memfd = build_argv(replace(_cfg(tmp_path), memory_backend="memfd"), "tcg", fds=FDS)
    assert "memory-backend-memfd,id=m0,size=512M,prealloc=on" in memfd
    huge = build_argv(replace(_cfg(tmp_path), memory_backend="hugepages"), "tcg", fds=FDS)
    assert "memory-backend-memfd,id=m0,size=512M,prealloc=on,hugetlb=on,hugetlbsize=2M" in huge
    kvm = build_argv(_cfg(tmp_path), "kvm", fds=FDS)
    assert "kvm" in kvm and "host,host-phys-bits=on" in kvm  # the guest addresses what the host CPU does


def test_command_line_confines_qemu_and_names_only_descriptors(tmp_path: Path) -> None:
    """Seccomp with every deny group, and no path QEMU would open or create: sockets and console are the
    descriptors the shim made (the state dir appears only as the console's fdset label, for /proc lookups)."""
    argv = build_argv(_cfg(tmp_path), "tcg", fds=FDS)
    assert argv[argv.index("-sandbox") + 1] == SANDBOX_ARG
    assert SANDBOX_ARG == "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
    assert "-runas" not in argv and "-chroot" not in argv  # the credentials are dropped before exec
    joined = " ".join(argv)
    for fd in (10, 11, 12, 13):
        assert f"fd={fd},server=on,wait=off" in joined
    assert f"fd=14,set=1,opaque={tmp_path / 'state' / 'console.log'}" in argv
    assert "unix:" not in joined and "path=agent.sock" not in joined and "exec:" not in joined
    assert [a for a in argv if str(tmp_path / "state") in a] == [f"fd=14,set=1,opaque={tmp_path / 'state'}/console.log"]


def test_vmlck_proof_accepts_locked_memory_and_names_the_layer_otherwise(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "status").write_text("Name:\tqemu\nVmLck:\t  600000 kB\nVmRSS:\t  540000 kB\n")
    (tmp_path / "7" / "smaps").write_text(_smaps((524288, 524288, 4), (65536, 65536, 4)))
    assert status_kib(7, tmp_path) == {"VmLck": 600000, "VmRSS": 540000}
    assert prove_pinned(7, 512, tmp_path)["guest_ram_locked_kib"] == 524288
    with pytest.raises(CubeError) as e:
        prove_pinned(7, 1024, tmp_path)
    assert e.value.layer == "pinned_memory" and e.value.code == "pinned_memory.not_locked"
    assert e.value.details["guest_kib"] == 1024 * 1024 and e.value.details["hint"]
    with pytest.raises(CubeError):
        prove_pinned(99, 1, tmp_path)  # gone: nothing locked


def _smaps(*maps: tuple[int, int, int]) -> str:
    """(size KiB, locked KiB, kernel page KiB) per mapping, in smaps' layout (as read on a real QEMU here)."""
    out = []
    for i, (size, locked, page) in enumerate(maps):
        out.append(
            f"7f{i:02x}00000000-7f{i:02x}10000000 rw-p 00000000 00:00 0 \nSize:     {size} kB\n"
            f"KernelPageSize:        {page} kB\nRss:   {locked} kB\nLocked:   {locked} kB\n"
        )
    return "".join(out)


def test_vmlck_from_qemu_itself_does_not_prove_the_guest_ram_is_locked(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "status").write_text("VmLck:\t  600000 kB\nVmRSS:\t  600000 kB\n")
    # 600 MB locked in all, but the 512 MiB guest RAM mapping only half: TCG cache and libraries make up VmLck.
    (tmp_path / "7" / "smaps").write_text(_smaps((524288, 262144, 4), (337856, 337856, 4)))
    with pytest.raises(CubeError) as e:
        prove_pinned(7, 512, tmp_path)
    assert e.value.details["guest_ram_locked_kib"] == 262144
    # Huge pages are never swapped and not counted as Locked: a huge-page mapping of the guest's size counts.
    (tmp_path / "7" / "smaps").write_text(_smaps((524288, 0, 2048)))
    assert prove_pinned(7, 512, tmp_path)["guest_ram_locked_kib"] == 524288


def test_this_process_is_not_locked_so_the_real_proof_fails() -> None:
    with pytest.raises(CubeError) as e:
        prove_pinned(os.getpid(), 64)
    assert e.value.layer == "pinned_memory"


def test_file_reports_are_json_lines_in_order(tmp_path: Path) -> None:
    r = Reporter("sb-1", None, tmp_path / "r.jsonl", tmp_path)
    r.report(VmStarted(pid=1))
    r.report(VmmExited(pid=1, status=0), ("d1",))
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["vm_started", "vmm_exited"] and lines[1]["device_ids"] == ["d1"]


def test_undeliverable_socket_reports_are_kept_in_the_state_dir(tmp_path: Path) -> None:
    r = Reporter("sb-1", tmp_path / "nobody.sock", None, tmp_path, retries=1)
    r.report(ShimExiting())
    kept = json.loads((tmp_path / "undelivered.jsonl").read_text())
    assert kept["kind"] == "shim_exiting"


@pytest.mark.parametrize("entry", [["-c", "from cubeaccel.cli import main; main()", "shim"], ["-m", "cubeaccel.shim"]])
def test_cli_rejects_a_spec_for_another_sandbox_with_exit_2(tmp_path: Path, entry: list[str]) -> None:
    spec = {
        "sandbox_id": "sb-1",
        "devices": [],
        "memory_mib": 256,
        "image_manifest": "/x/manifest.json",
        "state_dir": str(tmp_path),
        "report": {"file": str(tmp_path / "r")},
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, *entry, "run", "--sandbox", "sb-2", "--spec", str(tmp_path / "spec.json")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "shim.invalid_spec" in proc.stderr


def test_a_vmm_whose_exit_is_never_confirmed_is_reported_unreaped_not_exited(monkeypatch: Any) -> None:
    from cubeaccel.shim import vmm as vmm_mod

    monkeypatch.setattr(vmm_mod, "REAP_AFTER_KILL_S", 0.2)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def refuse() -> None:
        raise CubeError("vmm.qmp_failed", "no monitor", "backend")

    try:
        # poll_exit that never confirms: what a VMM stuck in D state looks like from the shim
        info = vmm_mod.stop_child(child, lambda: None, refuse, grace_s=0.1)
        assert info.how == "unreaped" and info.exit_code is None
    finally:
        child.kill()
        child.wait()


def test_the_probe_deadline_outlasts_the_agents_own_step_timeouts() -> None:
    from cubeaccel.agent.probes import ProbeContext
    from cubeaccel.shim.process import probe_timeout_s

    ctx = ProbeContext()
    assert probe_timeout_s(None) == 60.0
    frozen: dict[str, object] = {"guest_probes": {"modules": ["nvidia", "nvidia_uvm"], "cuda": {"version": "12.4"}}}
    assert probe_timeout_s(frozen) > 2 * ctx.modprobe_timeout_s + 2 * ctx.cuda_timeout_s
    assert probe_timeout_s({"probes": {"modules": ["a", "b", "c"]}}) > 3 * ctx.modprobe_timeout_s


def test_the_probe_deadline_stretches_with_the_hosts_load_as_the_agents_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The shim sends its load stretch with the probe; its own deadline still outlasts the stretched agent's."""
    from cubeaccel.agent.probes import ProbeContext
    from cubeaccel.shim import load_scale, process

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 0.0, 0.0))
    scale = load_scale.host_deadline_scale()
    assert scale == 2.5
    stretched = ProbeContext(root=tmp_path).stretched(scale)  # (no guest load of its own)
    frozen: dict[str, object] = {"guest_probes": {"modules": ["nvidia", "nvidia_uvm"], "cuda": {"version": "12.4"}}}
    assert process.probe_timeout_s(frozen, scale) > 2 * stretched.modprobe_timeout_s + 2 * stretched.cuda_timeout_s
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.0, 0.0))
    assert load_scale.host_deadline_scale() == 1.0
