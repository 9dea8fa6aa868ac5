"""Finding VMMs by pid and tag in /proc: a fake /proc tree, and a real tagged process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cubeaccel.backends.emulated import EDU_IDENTITY, EmulatedBackend, slot_address
from cubeaccel.host.vmmproc import ENV_DEVICES, argv0_tag, find_vmm, inspect, name_arg, vmm_processes
from cubeaccel.model.device import AcceleratorClass, DeviceRecord
from cubeaccel.model.states import DeviceState


def _proc(root: Path, pid: int, argv: list[str], env: dict[str, str], state: str = "S") -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    (d / "stat").write_text(f"{pid} (qemu-system-x86) {state} 1 1 1")


def _record(index: int, state: DeviceState = DeviceState.RELEASING) -> DeviceRecord:
    addr = slot_address(index)
    return DeviceRecord(id=f"emulated-{addr}", address=addr, identity=EDU_IDENTITY,
                        accel_class=AcceleratorClass.ACCELERATOR, backend="emulated", numa_node=0, iommu_group=None,
                        expected_driver=None, labels={}, state=state, generation=1, reason=None, sandbox_id="sb",
                        updated_at=0.0)


def test_tagged_vmms_are_found_and_untagged_or_zombie_processes_are_not(tmp_path: Path) -> None:
    _proc(tmp_path, 10, ["qemu-system-x86_64", "-name", name_arg("sb-a")], {ENV_DEVICES: "emulated-0000:e0:00.0"})
    _proc(tmp_path, 11, [argv0_tag("cloud-hypervisor", "sb-b"), "--api-socket", "path=/x"], {})
    _proc(tmp_path, 12, ["cat"], {"CUBEACCEL_SANDBOX": "sb-a"})  # inherited env alone is not a VMM
    _proc(tmp_path, 13, ["qemu-system-x86_64", "-name", name_arg("sb-c")], {}, state="Z")
    (tmp_path / "self").mkdir()
    assert [p.pid for p in vmm_processes(tmp_path)] == [10, 11]
    assert find_vmm("sb-a", tmp_path) == 10 and find_vmm("sb-b", tmp_path) == 11
    assert find_vmm("sb-c", tmp_path) is None and find_vmm("sb", tmp_path) is None
    assert inspect(10, tmp_path).device_ids == ("emulated-0000:e0:00.0",)  # type: ignore[union-attr]


def test_emulated_backend_holders_are_live_vmms_listing_the_device(tmp_path: Path) -> None:
    _proc(tmp_path, 20, ["qemu-system-x86_64", "-name", name_arg("sb-a")],
          {ENV_DEVICES: "emulated-0000:e0:00.0;emulated-0000:e0:01.0"})
    backend = EmulatedBackend(slots=3, proc_root=tmp_path, qemu=sys.executable)
    held, free = _record(0), _record(2)
    assert [h.pid for h in backend.holders(held)] == [20]
    assert backend.holders(free) == []
    assert [p.code for p in backend.cleanup(held)] == ["backend.vmm_still_running"]
    assert backend.cleanup(free) == [] and backend.validate(free) == []
    assert [p.code for p in backend.validate(held)] == ["host.device_held"]
    assert backend.attach_spec(free).driver == "edu"


def test_emulated_backend_discovers_labelled_slots_and_needs_qemu(tmp_path: Path) -> None:
    found = EmulatedBackend(slots=2, proc_root=tmp_path, qemu=sys.executable).discover()
    assert [str(d.address) for d in found] == ["0000:e0:00.0", "0000:e0:01.0"]
    assert found[0].labels["model"] == "edu" and found[0].labels["backend"] == "emulated"
    missing = EmulatedBackend(slots=1, proc_root=tmp_path, qemu="/nonexistent/qemu")
    assert [p.code for p in missing.validate(_record(0))] == ["backend.qemu_missing"]
    assert [p.code for p in missing.validate(_record(5))] == ["backend.qemu_missing", "host.device_missing"]


def test_a_real_tagged_process_is_found_until_it_exits() -> None:
    env = {**os.environ, ENV_DEVICES: "emulated-0000:e0:00.0"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-name", name_arg("real-1")],
                            env=env)
    try:
        deadline = time.monotonic() + 5
        while find_vmm("real-1") is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert find_vmm("real-1") == proc.pid
        assert [h.pid for h in EmulatedBackend().holders(_record(0, DeviceState.ATTACHED))] == [proc.pid]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert find_vmm("real-1") is None


def test_find_shim_matches_the_exact_sandbox_argument_of_a_live_shim() -> None:
    from cubeaccel.host.vmmproc import find_shim

    # A stand-in with a shim's argv: python -c '...' shim run --sandbox ab
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "shim", "run", "--sandbox", "ab"])
    try:
        deadline = time.monotonic() + 10
        while find_shim("ab") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert find_shim("ab") == p.pid
        assert find_shim("a") is None  # never a prefix match
    finally:
        p.kill()
        p.wait()
    assert find_shim("ab") is None


def test_process_shim_driver_takes_undelivered_reports_once_and_skips_garbage(tmp_path: Path) -> None:
    import json as _json

    from cubeaccel.cubelet.process_shim import ProcessShimDriver
    from cubeaccel.model.reports import ShimReport, ShimReportKind

    driver = ProcessShimDriver(tmp_path)
    keep = tmp_path / "shims" / "sb" / "undelivered.jsonl"
    keep.parent.mkdir(parents=True)
    late = ShimReport("sb", ShimReportKind.DEVICE_ATTACHED, ("d1",), {}, 2.0, "s1")
    early = ShimReport("sb", ShimReportKind.VM_STARTED, (), {"pid": 7}, 1.0, "s1")
    keep.write_text(_json.dumps(late.to_json()) + "\n{not json\n" + _json.dumps(early.to_json()) + "\n")
    assert driver.pending_reports("sb") == [early, late]
    assert driver.pending_reports("sb") == []
