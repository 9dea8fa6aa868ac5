"""The shim driven as its own process against real QEMU: report order, locked memory, hot-plug, detach, exit."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.backends.emulated import EDU_IDENTITY, EmulatedBackend, slot_address
from cubeaccel.host.service.unix_path import connect_path
from cubeaccel.host.vmm.vmmproc import find_vmm, inspect
from cubeaccel.images.builder import cache_dir, latest
from cubeaccel.images.manifest import Manifest, pin_template_document
from cubeaccel.model.contract import freeze
from cubeaccel.model.device import AcceleratorClass, DeviceRecord
from cubeaccel.model.states import DeviceState
from cubeaccel.wire.templates import parse_template
from tests.support.contract_builders import H100_FILE, example_doc
from tests.support.poll import poll
from tests.vm.conftest import RUN_INSTANCE, emulated_id
from tests.vm.test_cubelet_emulated import edu_contract
from tests.vm.test_gpu_image import stand_in_contract

pytestmark = pytest.mark.vm

FULL_CYCLE = [
    "vm_started",
    "vmm_confined",
    "memory_pinned",
    "guest_ready",
    "device_attached",
    "guest_validated",
    "device_detached",
    "vmm_exited",
    "shim_exiting",
]


def _record(device_id: str) -> DeviceRecord:
    addr = slot_address(0)
    return DeviceRecord(
        id=device_id,
        address=addr,
        identity=EDU_IDENTITY,
        accel_class=AcceleratorClass.ACCELERATOR,
        backend="emulated",
        numa_node=0,
        iommu_group=None,
        expected_driver=None,
        labels={},
        state=DeviceState.ATTACHED,
        generation=1,
        reason=None,
        sandbox_id="sb",
        updated_at=0.0,
    )


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def _assert_full_cycle(run: Any, kinds: list[str]) -> None:
    assert run.kinds() == kinds, run.log_tail()
    pinned = run.one("memory_pinned")["details"]
    assert pinned["vmlck_kib"] >= pinned["guest_kib"] == 256 * 1024
    attached = run.one("device_attached")
    assert attached["device_ids"] == [emulated_id(0)]
    assert attached["details"]["vendor_device"] == "1234:11e8"
    assert attached["details"]["guest_address"].startswith("0000:")
    exited = run.one("vmm_exited")["details"]
    assert exited["pid"] == run.one("vm_started")["details"]["pid"]
    assert exited["exit_code"] == 0 and exited["how"] == "quit"
    assert _gone(exited["pid"]) and find_vmm(run.sandbox_id) is None


def test_cold_boot_on_memfd_full_cycle_validates_contract(shim_factory: Any, guest_image: Manifest) -> None:
    run = shim_factory(start="cold", contract=edu_contract(guest_image), memory_backend="memfd").start()
    run.wait_for("guest_validated")
    assert run.one("vm_started")["details"]["accel"] in ("tcg", "kvm")
    assert run.terminate() == 0
    _assert_full_cycle(run, FULL_CYCLE)
    assert run.one("shim_exiting")["details"]["timeline"]["boot_to_agent_s"] > 0


def test_template_restore_full_cycle_with_the_image_found_by_digest(shim_factory: Any) -> None:
    run = shim_factory(start="template", explicit_image=False).start()
    run.wait_for("guest_validated")  # running: a stop before this cancels the probe, and there is no full cycle
    backend, record = EmulatedBackend(RUN_INSTANCE), _record(emulated_id(0))
    vmm_pid = run.one("vm_started")["details"]["pid"]
    assert [h.pid for h in backend.holders(record)] == [vmm_pid]  # found in /proc, not in memory
    assert [p.code for p in backend.cleanup(record)] == ["backend.vmm_still_running"]
    assert run.terminate() == 0
    _assert_full_cycle(run, FULL_CYCLE)
    assert backend.holders(record) == [] and backend.cleanup(record) == []
    named = json.loads(run.spec_path.read_text())["image_digest"]
    assert named is not None and run.one("vm_started")["details"]["image_digest"] == named
    timeline = run.one("shim_exiting")["details"]["timeline"]
    assert "restore_to_agent_s" in timeline and "boot_to_agent_s" not in timeline


def test_a_shape_with_no_snapshot_boots_cold_and_says_why_then_restores_once_prepared(
    shim_factory: Any, prepared_shapes: Any
) -> None:
    """The start path never makes a snapshot: the first sandbox of an unprepared shape boots cold, names the
    reason, and leaves no template behind; once the shape is prepared (host initialization), the next restores."""
    shape = 288  # a memory size no other test prepares
    templates = cache_dir() / "templates"
    keys_before = {p.name for p in templates.iterdir()} if templates.is_dir() else set()
    run = shim_factory(start="template", memory_mib=shape, prepared=False).start()
    run.wait_for("guest_validated")
    started = run.one("vm_started")["details"]
    assert (started["start"], started["cold_reason"]) == ("cold", "start.cold_no_snapshot")
    assert run.terminate() == 0
    timeline = run.one("shim_exiting")["details"]["timeline"]
    assert "boot_to_agent_s" in timeline and "template_create_s" not in timeline
    assert ({p.name for p in templates.iterdir()} if templates.is_dir() else set()) == keys_before
    prepared_shapes(shape, "ram")
    again = shim_factory(start="template", memory_mib=shape).start()
    again.wait_for("guest_validated")
    started = again.one("vm_started")["details"]
    assert (started["start"], started["cold_reason"]) == ("template", None)
    assert again.terminate() == 0
    assert "restore_to_agent_s" in again.one("shim_exiting")["details"]["timeline"]


def test_guest_failing_its_contract_is_reported_and_torn_down(shim_factory: Any, guest_image: Manifest) -> None:
    h100 = pin_template_document(example_doc(H100_FILE), guest_image)  # an H100 the edu guest does not have
    run = shim_factory(start="template", contract=freeze(parse_template(h100)).to_json()).start()
    run.wait_for("shim_exiting")
    assert run.proc.wait(30) == 1
    failed = run.one("guest_validation_failed")["details"]
    assert failed["failed_layers"]
    assert run.kinds()[-4:] == ["attach_failed", "device_detached", "vmm_exited", "shim_exiting"]


def test_paused_guest_never_completes_detach_so_shim_reports_timeout_then_stops_vmm(shim_factory: Any) -> None:
    from qemu.qmp.legacy import QEMUMonitorProtocol

    run = shim_factory(start="template", detach_timeout_s=1.5).start()
    run.wait_for("device_attached")
    aux = QEMUMonitorProtocol(connect_path(run.state_dir / "qmp-aux.sock"))
    aux.connect()
    aux.cmd("stop")  # the guest can no longer answer the ACPI unplug request
    aux.close()
    vmm_pid = run.one("vm_started")["details"]["pid"]
    assert run.terminate() == 0
    kinds = run.kinds()
    assert "device_detached" not in kinds
    assert kinds[-3:] == ["detach_timeout", "vmm_exited", "shim_exiting"]
    assert run.one("detach_timeout")["device_ids"] == [emulated_id(0)]
    assert _gone(vmm_pid) and run.one("vmm_exited")["details"]["pid"] == vmm_pid


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping CAP_IPC_LOCK needs root")
def test_insufficient_memlock_fails_with_pinned_memory_before_any_hotplug(shim_factory: Any) -> None:
    run = shim_factory(start="cold")
    # As root, CAP_IPC_LOCK overrides RLIMIT_MEMLOCK: drop it, then set a 64 KiB limit.
    run.start(
        wrapper=(
            "setpriv",
            "--inh-caps=-ipc_lock",
            "--bounding-set=-ipc_lock",
            "prlimit",
            "--memlock=65536:65536",
            "--",
        )
    )
    run.wait_for("shim_exiting", timeout_s=60)
    assert run.proc.wait(30) == 1
    failed = run.one("attach_failed")["details"]
    assert failed["layer"] == "pinned_memory"
    assert failed["reason"].startswith("pinned_memory.")
    assert "CAP_IPC_LOCK" in failed["hint"]
    assert not {"device_attached", "memory_pinned", "guest_ready"} & set(run.kinds())


def test_killed_shim_leaves_its_vmm_findable_by_pid_and_tag(shim_factory: Any) -> None:
    run = shim_factory(start="template").start()
    run.wait_for("device_attached")
    vmm_pid = run.one("vm_started")["details"]["pid"]
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait(10)
    assert find_vmm(run.sandbox_id) == vmm_pid
    found = inspect(vmm_pid)
    assert found is not None and found.device_ids == (emulated_id(0),)
    os.kill(vmm_pid, signal.SIGKILL)  # what Cubelet's release rules do with an orphaned VMM
    poll(lambda: find_vmm(run.sandbox_id) is None, 10, 0.02)
    assert "vmm_exited" not in run.kinds()  # nobody waited for it: the shim never claims an exit it did not see


def test_vfio_device_add_failure_is_reported_and_the_vm_torn_down(shim_factory: Any) -> None:
    # No IOMMU on these machines: QEMU refuses vfio-pci (`no iommu_group found` / no such device).
    device = {
        "device_id": "vfio-0000:00:01.0",
        "driver": "vfio-pci",
        "properties": {"host": "0000:00:01.0"},
        "vendor_id": "10de",
        "device_id_hex": "2330",
    }
    run = shim_factory(start="template", device=device).start()
    run.wait_for("shim_exiting")
    assert run.proc.wait(30) == 1
    failed = run.one("attach_failed")
    assert failed["details"]["reason"] == "attach.device_add_failed" and failed["details"]["layer"] == "backend"
    assert "vfio" in failed["details"]["message"].lower() or "iommu" in failed["details"]["message"].lower()
    assert run.kinds() == [
        "vm_started",
        "vmm_confined",
        "memory_pinned",
        "guest_ready",
        "attach_failed",
        "vmm_exited",
        "shim_exiting",
    ]


def test_vmm_killed_from_outside_is_reported_without_claiming_a_detach(shim_factory: Any) -> None:
    run = shim_factory(start="template").start()
    run.wait_for("guest_validated")  # running: every sandbox is validated in the guest first
    vmm_pid = run.one("vm_started")["details"]["pid"]
    os.kill(vmm_pid, signal.SIGKILL)
    run.wait_for("shim_exiting", timeout_s=30)
    assert run.proc.wait(30) == 1
    exited = run.one("vmm_exited")["details"]
    assert exited["pid"] == vmm_pid and exited["signal"] == signal.SIGKILL and exited["how"] == "exited"
    assert run.one("shim_exiting")["details"]["reason"] == "vmm_exited_unexpectedly"
    assert not {"device_detached", "detach_timeout"} & set(run.kinds())


def test_frozen_edu_template_contract_is_enforced_on_the_image_and_validated_in_the_guest(
    shim_factory: Any, guest_image: Manifest
) -> None:
    from dataclasses import replace

    from cubeaccel.model.contract import freeze
    from cubeaccel.model.template_spec import GuestKernel, ModulesImg
    from cubeaccel.wire.templates import load_template

    edu = load_template(Path(__file__).parents[2] / "src" / "cubeaccel" / "examples" / "templates" / "edu-demo.yaml")
    built = latest()  # the session image, or a rebuild if a source file changed meanwhile
    assert built is not None
    pinned = replace(
        edu,
        guest_image_digest=built.image_digest,
        guest_kernel=GuestKernel(built.kernel_release, built.vmlinux.sha256),
        modules_img=ModulesImg(built.kernel_release, built.modules_img.sha256),
    )
    run = shim_factory(start="template", contract=freeze(pinned).to_json(), explicit_image=False)
    spec = json.loads(run.spec_path.read_text())
    run.spec_path.write_text(json.dumps({**spec, "image_check": "enforce"}))
    run.start()
    run.wait_for("guest_validated")
    assert run.one("vm_started")["details"]["image_mismatches"] == []
    assert run.terminate() == 0
    assert run.kinds()[-3:] == ["device_detached", "vmm_exited", "shim_exiting"]


def test_two_devices_go_to_their_own_root_ports_and_both_detach(shim_factory: Any) -> None:
    run = shim_factory(start="template", devices=2).start()

    def both_attached() -> bool:
        kinds: list[str] = run.kinds()
        assert "shim_exiting" not in kinds, run.log_tail()  # fails the wait at once
        return kinds.count("device_attached") >= 2

    poll(both_attached, 60)
    assert run.terminate() == 0
    attached = [r for r in run.reports() if r["kind"] == "device_attached"]
    assert [r["details"]["bus"] for r in attached] == ["rp1", "rp2"]
    assert len({r["details"]["guest_address"] for r in attached}) == 2
    detached = sorted(r["device_ids"][0] for r in run.reports() if r["kind"] == "device_detached")
    assert detached == [emulated_id(0), emulated_id(1)]
    assert run.kinds()[-2:] == ["vmm_exited", "shim_exiting"]


def test_nvidia_contract_in_a_guest_without_nvidia_fails_at_modules_img_and_kernel_driver(
    shim_factory: Any, guest_image: Manifest
) -> None:
    run = shim_factory(start="template", contract=stand_in_contract(guest_image)).start()  # CUDA on the edu device
    run.wait_for("shim_exiting")
    failed = run.one("guest_validation_failed")["details"]
    assert {"modules_img", "kernel_driver"} <= set(failed["failed_layers"])
    assert "host_hardware" not in failed["failed_layers"]  # the edu device itself was seen
