"""A template VM with a hot-plugged device is never saved (real QEMU): the refusal comes from QEMU's own
answer (`query-pci`), not from the shim's record of what it attached."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.images.manifest import Manifest
from cubeaccel.protocol.errors import CubeError
from cubeaccel.shim import snapshot_guard as guard
from cubeaccel.shim.agent_client import AgentClient
from cubeaccel.shim.qemu import QemuVmm
from cubeaccel.shim.vmm import VmConfig
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms

pytestmark = pytest.mark.vm


@pytest.fixture
def template_vm(tmp_path: Path, guest_image: Manifest) -> Iterator[QemuVmm]:
    cfg = VmConfig(
        sandbox_id=f"template-guard-{tmp_path.name[-8:]}",
        memory_mib=256,
        vcpus=1,
        pin_memory=False,
        kernel=guest_image.path(guest_image.vmlinux),
        initrd=guest_image.path(guest_image.initrd),
        cmdline=guest_image.cmdline,
        state_dir=tmp_path / "vm",
    )
    vmm = QemuVmm(cfg)
    try:
        vmm.start()
        agent = AgentClient(cfg.state_dir / "agent.sock")
        agent.connect(10.0)
        agent.wait_hello(90.0)  # the guest enumerated its root ports: a hot-plug shows in query-pci
        agent.close()
        yield vmm
    finally:
        if vmm.started:
            vmm.stop(5.0)
        kill_started_vmms(tmp_path)


def _behind_root_ports(vmm: QemuVmm) -> list[dict[str, object]]:
    return [f for f in guard.foreign_pci(vmm.qmp("query-pci")) if f["behind"] is not None]


def test_a_hot_plugged_edu_is_seen_by_query_pci_and_the_snapshot_is_refused(
    template_vm: QemuVmm, tmp_path: Path
) -> None:
    vmm = template_vm
    # Added over QMP behind the shim's back: its own record (`attached`) stays empty.
    vmm.qmp("device_add", driver="edu", id="intruder", bus="rp1")
    assert vmm.attached == {}
    found = poll(lambda: _behind_root_ports(vmm), 10, 0.02)
    assert [(f["behind"], f["vendor_device"]) for f in found] == [("rp1", "1234:11e8")]
    state = tmp_path / "state"
    with pytest.raises(CubeError) as e:
        vmm.save_state(state)
    assert e.value.code == "lifecycle.snapshot_with_device" and e.value.layer == "backend"
    sources = {(d["source"], d.get("vendor_device") or d.get("type")) for d in e.value.details["devices"]}
    assert ("query-pci", "1234:11e8") in sources and ("qom", "edu") in sources
    assert not state.exists() and not state.with_suffix(".partial").exists()
    assert vmm.qmp("query-migrate").get("status") is None  # no migration was ever started
    # Once QEMU confirms the device is gone, the same VM is saved: the refusal was about the device.
    vmm.qmp("cont")
    vmm.request_remove("intruder")
    assert vmm.wait_removed({"intruder"}, 10.0) == {"intruder"}
    vmm.save_state(state)
    assert state.stat().st_size > 0
