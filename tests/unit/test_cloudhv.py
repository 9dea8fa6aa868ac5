"""CloudHypervisorVmm against a fake cloud-hypervisor process (real subprocess, real unix-socket HTTP)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.host.vmmproc import find_vmm, inspect
from cubeaccel.model.errors import CubeError
from cubeaccel.shim.cloudhv import CloudHypervisorVmm, parse_events, vm_config
from cubeaccel.shim.vmm import VmConfig

FAKE = [sys.executable, str(Path(__file__).with_name("fake_cloudhv.py"))]


def _cfg(tmp_path: Path, sandbox: str = "ch-1") -> VmConfig:
    return VmConfig(
        sandbox_id=sandbox,
        memory_mib=512,
        vcpus=2,
        pin_memory=True,
        kernel=tmp_path / "vmlinux",
        initrd=tmp_path / "initrd.img",
        cmdline="console=ttyS0",
        state_dir=tmp_path / "state",
        device_ids=("vfio-0000:3b:00.0",),
    )


@pytest.fixture
def vmm(tmp_path: Path) -> Iterator[CloudHypervisorVmm]:
    v = CloudHypervisorVmm(_cfg(tmp_path), binary=FAKE)
    v.start()
    yield v
    if v.poll_exit() is None:
        v.stop(2.0)


def test_create_body_prefaults_memory_and_boots_the_image(tmp_path: Path) -> None:
    body = vm_config(_cfg(tmp_path))
    assert body["memory"] == {"size": 512 << 20, "prefault": True, "shared": False}
    assert body["payload"]["kernel"].endswith("vmlinux") and body["cpus"]["boot_vcpus"] == 2


def test_vfio_device_is_added_removed_on_event_and_vmm_exits(vmm: CloudHypervisorVmm) -> None:
    assert find_vmm("ch-1") == vmm.pid
    found = inspect(vmm.pid)
    assert found is not None and found.device_ids == ("vfio-0000:3b:00.0",)
    att = vmm.add_device("accel0", "vfio-pci", {"host": "0000:3b:00.0"}, 0)
    assert att.qdev_id == "accel0" and att.guest_bdf == "0000:00:06.0"
    vmm.request_remove("accel0")
    assert vmm.wait_removed({"accel0"}, 5.0) == {"accel0"}
    info = vmm.stop(5.0)
    assert info.exit_code == 0 and info.how == "quit"
    assert find_vmm("ch-1") is None


def test_unplug_without_device_removed_event_times_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CH_IGNORE_REMOVE", "1")
    v = CloudHypervisorVmm(_cfg(tmp_path, "ch-2"), binary=FAKE)
    v.start()
    try:
        v.add_device("accel0", "vfio-pci", {"host": "0000:3b:00.0"}, 0)
        v.request_remove("accel0")  # accepted (204) ...
        assert v.wait_removed({"accel0"}, 0.3) == set()  # ... but never confirmed
    finally:
        assert v.stop(5.0).exit_code == 0


def test_emulated_devices_and_bad_addresses_are_refused(vmm: CloudHypervisorVmm) -> None:
    with pytest.raises(CubeError) as e:
        vmm.add_device("accel0", "edu", {}, 0)
    assert e.value.code == "vmm.unsupported_device"
    with pytest.raises(CubeError) as e:
        vmm.add_device("accel0", "vfio-pci", {"host": "../../etc"}, 0)
    assert e.value.code == "device.invalid_address"


def test_api_errors_carry_the_status(vmm: CloudHypervisorVmm) -> None:
    with pytest.raises(CubeError) as e:
        vmm.request_remove("never-added")
    assert e.value.code == "vmm.api_error" and e.value.details["status_code"] == 500


_event = st.fixed_dictionaries(
    {
        "event": st.sampled_from(["booted", "device-removed", "shutdown"]),
        "properties": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
    }
)


@given(st.lists(_event, max_size=5), st.integers(min_value=0, max_value=40))
def test_event_stream_decodes_whole_objects_and_ignores_a_partial_tail(
    events: list[dict[str, object]], cut: int
) -> None:
    text = "".join(json.dumps(e, indent=2) + "\n\n" for e in events)
    assert parse_events(text) == events
    partial = json.dumps({"event": "device-removed", "properties": {"id": "x"}}, indent=2)[:cut]
    assert parse_events(text + partial) == events + ([] if cut < 40 else parse_events(partial))
