"""Finding VMMs by pid and tag in /proc: a fake /proc tree, and a real tagged process.

Device ids carry an instance id unique to the test (as a Cubelet's carry its own), so a real VMM of another
run on this host never lists them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from cubeaccel.backends.emulated import EDU_IDENTITY, EmulatedBackend, slot_address
from cubeaccel.host.vmm.vmmproc import ENV_DEVICES, find_vmm, inspect, name_arg, vmm_processes
from cubeaccel.model.device import AcceleratorClass, DeviceRecord, device_id_for
from cubeaccel.model.states import DeviceState
from tests.support.poll import poll

INST = uuid.uuid4().hex[:8]


def _proc(root: Path, pid: int, argv: list[str], env: dict[str, str], state: str = "S") -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    (d / "stat").write_text(f"{pid} (qemu-system-x86) {state} 1 1 1")


def _id(index: int, instance: str = INST) -> str:
    return device_id_for("emulated", slot_address(index), instance)


def _record(index: int, state: DeviceState = DeviceState.RELEASING, instance: str = INST) -> DeviceRecord:
    addr = slot_address(index)
    return DeviceRecord(
        id=_id(index, instance),
        address=addr,
        identity=EDU_IDENTITY,
        accel_class=AcceleratorClass.ACCELERATOR,
        backend="emulated",
        numa_node=0,
        iommu_group=None,
        expected_driver=None,
        labels={},
        state=state,
        generation=1,
        reason=None,
        sandbox_id="sb",
        updated_at=0.0,
    )


def test_tagged_vmms_are_found_and_untagged_or_zombie_processes_are_not(tmp_path: Path) -> None:
    _proc(tmp_path, 10, ["qemu-system-x86_64", "-name", name_arg("sb-a")], {ENV_DEVICES: "emulated-0000:e0:00.0"})
    _proc(tmp_path, 11, ["qemu-system-x86_64", "-name", f"{name_arg('sb-b')},debug-threads=on"], {})
    _proc(tmp_path, 12, ["cat"], {"CUBEACCEL_SANDBOX": "sb-a"})  # inherited env alone is not a VMM
    _proc(tmp_path, 13, ["qemu-system-x86_64", "-name", name_arg("sb-c")], {}, state="Z")
    (tmp_path / "self").mkdir()
    assert [p.pid for p in vmm_processes(tmp_path)] == [10, 11]
    assert find_vmm("sb-a", tmp_path) == 10 and find_vmm("sb-b", tmp_path) == 11
    assert find_vmm("sb-c", tmp_path) is None and find_vmm("sb", tmp_path) is None
    assert inspect(10, tmp_path).device_ids == ("emulated-0000:e0:00.0",)  # type: ignore[union-attr]


def test_emulated_backend_holders_are_live_vmms_listing_the_device(tmp_path: Path) -> None:
    _proc(tmp_path, 20, ["qemu-system-x86_64", "-name", name_arg("sb-a")], {ENV_DEVICES: f"{_id(0)};{_id(1)}"})
    backend = EmulatedBackend(INST, slots=3, proc_root=tmp_path, qemu=sys.executable)
    held, free = _record(0), _record(2)
    assert [h.pid for h in backend.holders(held)] == [20]
    assert backend.holders(free) == []
    assert [p.code for p in backend.cleanup(held)] == ["backend.vmm_still_running"]
    assert backend.cleanup(free) == [] and backend.validate(free) == []
    assert [p.code for p in backend.validate(held)] == ["host.device_held"]
    assert backend.attach_spec(free).driver == "edu"


def test_emulated_backend_discovers_labelled_slots_and_needs_qemu(tmp_path: Path) -> None:
    found = EmulatedBackend(INST, slots=2, proc_root=tmp_path, qemu=sys.executable).discover()
    assert [str(d.address) for d in found] == ["0000:e0:00.0", "0000:e0:01.0"]
    assert [d.device_id for d in found] == [f"emulated-{INST}-0000:e0:00.0", f"emulated-{INST}-0000:e0:01.0"]
    assert found[0].labels["model"] == "edu" and found[0].labels["backend"] == "emulated"
    missing = EmulatedBackend(INST, slots=1, proc_root=tmp_path, qemu="/nonexistent/qemu")
    assert [p.code for p in missing.validate(_record(0))] == ["backend.qemu_missing"]
    assert [p.code for p in missing.validate(_record(5))] == ["backend.qemu_missing", "host.device_missing"]
    other = _record(0, instance="0ther")  # another Cubelet's slot 0 is no device of this one
    assert [p.code for p in missing.validate(other)] == ["backend.qemu_missing", "host.device_missing"]


def test_a_real_tagged_process_is_found_until_it_exits() -> None:
    env = {**os.environ, ENV_DEVICES: _id(0)}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-name", name_arg("real-1")], env=env)
    try:
        assert poll(lambda: find_vmm("real-1"), 5, 0.01) == proc.pid
        assert [h.pid for h in EmulatedBackend(INST).holders(_record(0, DeviceState.ATTACHED))] == [proc.pid]
        assert EmulatedBackend("0ther").holders(_record(0, DeviceState.ATTACHED, "0ther")) == []
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert find_vmm("real-1") is None


def test_find_shim_matches_the_exact_sandbox_argument_of_a_live_shim() -> None:
    from cubeaccel.host.vmm.vmmproc import find_shim

    # A stand-in with a shim's argv: python -c '...' shim run --sandbox ab
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "shim", "run", "--sandbox", "ab"])
    try:
        assert poll(lambda: find_shim("ab"), 10, 0.02) == p.pid
        assert find_shim("a") is None  # never a prefix match
    finally:
        p.kill()
        p.wait()
    assert find_shim("ab") is None


def test_process_shim_driver_takes_undelivered_reports_once_and_skips_garbage(tmp_path: Path) -> None:
    import json as _json

    from cubeaccel.cubelet.process_shim import ProcessShimDriver
    from cubeaccel.protocol.reports import ShimReport, ShimReportKind
    from cubeaccel.wire.reports import report_json

    driver = ProcessShimDriver(tmp_path)
    keep = tmp_path / "shims" / "sb" / "undelivered.jsonl"
    keep.parent.mkdir(parents=True)
    late = ShimReport("sb", ShimReportKind.DEVICE_ATTACHED, ("d1",), {}, 2.0, "s1")
    early = ShimReport("sb", ShimReportKind.VM_STARTED, (), {"pid": 7}, 1.0, "s1")
    keep.write_text(_json.dumps(report_json(late)) + "\n{not json\n" + _json.dumps(report_json(early)) + "\n")
    assert driver.pending_reports("sb") == [early, late]
    assert driver.pending_reports("sb") == []


def test_two_cubelets_on_one_host_never_take_each_others_vmms_for_holders(tmp_path: Path) -> None:
    from cubeaccel.cubelet.runtime import instance_id

    a_dir, b_dir, proc = tmp_path / "cubelet-a", tmp_path / "cubelet-b", tmp_path / "proc"
    a_dir.mkdir()
    b_dir.mkdir()
    a, b = instance_id(a_dir), instance_id(b_dir)
    assert a != b and instance_id(a_dir) == a  # stable across a restart of the same Cubelet
    back_a, back_b = (EmulatedBackend(i, slots=2, proc_root=proc, qemu=sys.executable) for i in (a, b))
    a0, b0 = back_a.discover()[0], back_b.discover()[0]
    assert a0.address == b0.address and a0.device_id != b0.device_id  # same slot, different devices
    # Each Cubelet's VMM holds its own slot 0 (same sandbox id: sandbox ids are each Cubelet's to choose).
    _proc(
        proc,
        30,
        ["qemu-system-x86_64", "-name", name_arg("sb"), "-qmp", f"unix:{a_dir}/shims/sb/qmp.sock"],
        {ENV_DEVICES: a0.device_id},
    )
    _proc(
        proc,
        31,
        ["qemu-system-x86_64", "-name", name_arg("sb"), "-qmp", f"unix:{b_dir}/shims/sb/qmp.sock"],
        {ENV_DEVICES: b0.device_id},
    )
    rec_a, rec_b = _record(0, DeviceState.ATTACHED, a), _record(0, DeviceState.ATTACHED, b)
    assert [h.pid for h in back_a.holders(rec_a)] == [30] and [h.pid for h in back_b.holders(rec_b)] == [31]
    # When b's VMM is gone, a's still-running VMM does not make b's device look held (nor the reverse).
    (proc / "31" / "stat").write_text("31 (qemu-system-x86) Z 1 1 1")
    assert back_b.holders(rec_b) == [] and back_b.cleanup(rec_b) == []
    assert [p.code for p in back_a.cleanup(rec_a)] == ["backend.vmm_still_running"]
    # Finding "the VMM of sandbox sb" is scoped the same way: by the Cubelet's own shims directory.
    assert find_vmm("sb", proc, under=a_dir / "shims") == 30
    assert find_vmm("sb", proc, under=b_dir / "shims") is None
    assert find_vmm("sb", proc, under=tmp_path / "cubelet") is None  # a path prefix is not a directory


def test_a_shim_of_another_cubelet_with_the_same_sandbox_id_is_not_ours(tmp_path: Path) -> None:
    from cubeaccel.host.vmm.vmmproc import find_shim

    mine, theirs = tmp_path / "a" / "shims", tmp_path / "b" / "shims"
    _proc(
        tmp_path / "proc",
        40,
        ["python", "-m", "cubeaccel.shim", "run", "--sandbox", "sb", "--spec", f"{theirs}/sb.json"],
        {},
    )
    assert find_shim("sb", tmp_path / "proc") == 40
    assert find_shim("sb", tmp_path / "proc", under=theirs) == 40
    assert find_shim("sb", tmp_path / "proc", under=mine) is None


def test_a_tagged_process_without_evidence_is_no_holder(tmp_path: Path) -> None:
    """Issue 19 #6: any local user (or another Cubelet) could run a process with the tag and the device list
    and quarantine emulated devices. A holder's files must lie under this Cubelet's shims dir and it must
    run as the Cubelet's uid."""
    shims, proc = tmp_path / "cubelet" / "shims", tmp_path / "proc"
    back = EmulatedBackend(INST, slots=1, proc_root=proc, qemu=sys.executable, vmm_root=shims, uid=1000)
    rec = _record(0, DeviceState.ALLOCATABLE)

    def tagged(pid: int, files: Path, uid: int) -> None:
        _proc(
            proc,
            pid,
            ["qemu-system-x86_64", "-name", name_arg("sb"), "-D", f"{files}/sb/vmm.log"],
            {ENV_DEVICES: rec.id},
        )
        (proc / str(pid) / "status").write_text(f"Name:\tqemu\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")

    tagged(50, tmp_path / "elsewhere", 1000)  # our uid, files elsewhere: another Cubelet or a forgery
    tagged(51, shims, 65534)  # names our dir, but another user's process
    assert back.holders(rec) == []
    assert back.validate(rec) == [] and back.health(rec) == []
    tagged(52, shims, 1000)  # our own VMM
    assert [h.pid for h in back.holders(rec)] == [52]


def test_the_runtime_builds_the_emulated_backend_with_its_evidence(tmp_path: Path) -> None:
    from cubeaccel.cubelet.runtime import RuntimeOptions, build_cubelet

    opts = RuntimeOptions(state_dir=tmp_path, backend="emulated")
    backend = build_cubelet(opts).backend
    assert isinstance(backend, EmulatedBackend)
    assert backend.vmm_root == (tmp_path / "shims").absolute() and backend.uid == os.getuid()
