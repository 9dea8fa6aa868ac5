"""Host readiness at host initialization: a VFIO Cubelet over a fake tree shaped like this PVM machine (no IOMMU,
kvm_pvm, no /dev/vfio) advertises nothing, and becomes allocatable on its own once the host is fixed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cubeaccel.backends.emulated import EmulatedBackend
from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cubelet.heartbeat import heartbeat_body
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import Cubelet, CubeletConfig, ReservationRequest
from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.runtime import assemble
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.readiness import HostRoots
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from tests.support.fake_sysfs import Dev, FakeSysfs

S = DeviceState
GPU, NV = "0000:3b:00.0", "0000:af:00.0"  # one already on vfio-pci, one still on nvidia


def _pvm_tree(base: Path) -> FakeSysfs:
    """This machine's shape: kvm_pvm, no IOMMU groups or units, no /dev/vfio."""
    return FakeSysfs.build(
        base,
        [Dev(GPU, iommu_group=None, driver="vfio-pci"), Dev(NV, iommu_group=None)],
        iommu=False,
        modules=("kvm", "kvm_pvm", "vfio_pci"),
        dev_files=("kvm",),
    )


def _fix(fake: FakeSysfs) -> None:
    """The operator boots hardware KVM with intel_iommu=on and loads vfio: what a ready host shows."""
    shutil.rmtree(fake.sys / "module" / "kvm_pvm")
    (fake.sys / "module" / "kvm_intel" / "parameters").mkdir(parents=True)
    (fake.proc / "modules").write_text("vfio_pci 16384 0 - Live 0x0\nkvm_intel 16384 0 - Live 0x0\n")
    (fake.sys / "class" / "iommu" / "dmar0" / "intel-iommu").mkdir(parents=True)
    (fake.sys / "class" / "iommu" / "dmar0" / "intel-iommu" / "ecap").write_text("f020df\n")
    for group, addr in ((1, GPU), (2, NV)):
        gdir = fake.sys / "kernel" / "iommu_groups" / str(group)
        (gdir / "devices").mkdir(parents=True)
        (fake.devdir(addr) / "iommu_group").symlink_to(gdir)
        (gdir / "devices" / addr).symlink_to(fake.devdir(addr))
    (fake.dev / "vfio").mkdir()
    (fake.dev / "vfio" / "vfio").write_text("")


def _cubelet(tmp: Path, fake: FakeSysfs) -> Cubelet:
    backend = VfioBackend(fake.host(), readiness_roots=HostRoots(fake.sys, fake.dev, fake.proc))
    return assemble(Store(tmp / "cubelet.db"), backend, ProcessShimDriver(tmp), CubeletConfig())


def _kinds(c: Cubelet, *kinds: str) -> list[str]:
    return [e.kind for e in c.store.events(0, 10000) if e.kind in kinds]


def test_pvm_host_without_iommu_advertises_nothing_and_binds_nothing(tmp_path: Path) -> None:
    fake = _pvm_tree(tmp_path / "fake")
    c = _cubelet(tmp_path, fake)
    initialize_host(c)
    reconcile(c)
    devs = {str(d.address): d for d in c.store.devices()}
    assert {d.state for d in devs.values()} == {S.INITIALIZED}  # registered, never allocatable
    assert {d.reason for d in devs.values()} == {"host.no_iommu"}
    assert fake.write_log() == []  # nothing was rebound to vfio-pci on a host that cannot pass it through
    body = heartbeat_body(c, "http://127.0.0.1:1")
    assert body["ready"] is False and body["capacity"]["allocatable"] == 0
    codes = [p["code"] for p in body["host_problems"]]
    assert {"host.no_iommu", "host.pvm_unsupported", "host.no_vfio_device"} <= set(codes)
    assert all(p["message"] for p in body["host_problems"])
    with pytest.raises(CubeError) as err:
        c.reserve("sb-1", ReservationRequest())
    assert (err.value.code, err.value.layer, err.value.status) == ("host.not_ready", "host_hardware", 409)
    assert "host.pvm_unsupported" in err.value.message
    assert c.store.reservations() == []
    assert _kinds(c, "host_ready", "host_not_ready") == ["host_not_ready"]  # one event, not one per tick


def test_devices_become_allocatable_without_an_operator_once_the_host_is_ready(tmp_path: Path) -> None:
    fake = _pvm_tree(tmp_path / "fake")
    c = _cubelet(tmp_path, fake)
    initialize_host(c)
    _fix(fake)
    for _ in range(3):
        reconcile(c)
    by_addr = {str(d.address): d for d in c.store.devices()}
    assert by_addr[GPU].state is S.ALLOCATABLE and by_addr[GPU].reason is None
    assert "bus/pci/devices/0000:af:00.0/driver_override=vfio-pci" in fake.write_log()  # rebound only now
    assert _kinds(c, "host_ready", "host_not_ready") == ["host_not_ready", "host_ready"]
    assert heartbeat_body(c, "http://127.0.0.1:1")["ready"] is True
    assert c.reserve("sb-1", ReservationRequest(memory_mib=256)).device_ids == [f"vfio-{GPU}"]


def test_a_host_that_stops_being_ready_takes_idle_devices_back_to_initialized(tmp_path: Path) -> None:
    fake = FakeSysfs.build(tmp_path / "fake", [Dev(GPU, iommu_group=1, driver="vfio-pci")])
    c = _cubelet(tmp_path, fake)
    initialize_host(c)
    assert [d.state for d in c.store.devices()] == [S.ALLOCATABLE]
    shutil.rmtree(fake.sys / "bus" / "pci" / "drivers" / "vfio-pci")  # someone unloaded vfio-pci
    reconcile(c)
    (d,) = c.store.devices()
    assert (d.state, d.reason) == (S.INITIALIZED, "host.vfio_pci_unavailable")
    trail = [e.event for e in c.store.events(0, 10000, d.id) if e.kind == "transition"]
    assert trail[-1] == "host_not_ready"
    fake.add_driver("vfio-pci")
    (fake.sys / "bus" / "pci" / "drivers" / "vfio-pci" / GPU).symlink_to(fake.devdir(GPU))
    reconcile(c)
    assert [d.state for d in c.store.devices()] == [S.ALLOCATABLE]


def test_emulated_backend_needs_only_qemu(tmp_path: Path) -> None:
    assert EmulatedBackend("cafe0001", qemu=str(tmp_path / "no-qemu")).readiness()[0].code == "host.qemu_missing"
    (tmp_path / "qemu").write_text("")
    assert EmulatedBackend("cafe0001", qemu=str(tmp_path / "qemu")).readiness() == []  # no IOMMU, no KVM needed
