"""NVSwitch (HGX) nodes on fake sysfs trees: `cubeaccel host check` names the NVSwitch functions and what this release
supports there, and a VFIO Cubelet keeps that node's NVIDIA GPUs out — registered, `initialized` with the reason,
never bound to vfio-pci, never advertised — while other devices on the same host are served as usual."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from cubeaccel.backends import nvidia
from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cli import app
from cubeaccel.cubelet.heartbeat import heartbeat_body
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import Cubelet, CubeletConfig, ReservationRequest
from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.runtime import assemble
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.base import PciFunction
from cubeaccel.host.pci.readiness import HostRoots
from cubeaccel.model.device import PciAddress
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from tests.support.cubelet_harness import Node
from tests.support.fake_sysfs import Dev, FakeSysfs

S = DeviceState
CODE = "backend.nvswitch_fabric_unmanaged"
EDU = "0000:05:00.0"


def _gpus() -> list[Dev]:
    return [Dev(f"0000:{0x18 + 0x10 * i:02x}:00.0", iommu_group=10 + i) for i in range(8)]


def _switches() -> list[Dev]:
    """HGX H100's four third-generation NVSwitches: 10de:22a3, class 0x068000, no driver on a VFIO host."""
    return [
        Dev(f"0000:{0x07 + i:02x}:00.0", device=0x22A3, class_code=0x068000, iommu_group=30 + i, driver=None)
        for i in range(4)
    ]


def _edu() -> Dev:
    return Dev(EDU, vendor=0x1234, device=0x11E8, class_code=0x00FF00, subsystem_vendor=0x1AF4, iommu_group=40)


def _hgx(base: Path, switches: bool = True) -> FakeSysfs:
    return FakeSysfs.build(base, [*_gpus(), *(_switches() if switches else []), _edu()])


def _cubelet(tmp: Path, fake: FakeSysfs) -> Cubelet:
    backend = VfioBackend(
        fake.host(), allow=("10de:*", "1234:11e8"), readiness_roots=HostRoots(fake.sys, fake.dev, fake.proc)
    )
    return assemble(Store(tmp / "cubelet.db"), backend, ProcessShimDriver(tmp), CubeletConfig(pinnable_memory_mib=4096))


def _check(fake: FakeSysfs, *extra: str) -> tuple[int, str]:
    args = ["host", "check", "--sysfs-root", str(fake.sys), "--dev-root", str(fake.dev), "--proc-root", str(fake.proc)]
    result = CliRunner().invoke(app, [*args, *extra])
    return result.exit_code, result.output


def test_host_check_on_an_hgx_node_names_the_nvswitches_and_what_the_operator_can_do(tmp_path: Path) -> None:
    fake = _hgx(tmp_path)
    code, out = _check(fake, "--json")
    report = json.loads(out)
    nvswitch = next(c for c in report["checks"] if c["name"] == "nvswitch")
    assert (nvswitch["status"], nvswitch["code"]) == ("warn", CODE)
    reason = nvswitch["reason"]
    assert "4 NVSwitch function(s) (NVSwitch gen3, HGX H100/H200)" in reason and "8 NVIDIA GPU(s)" in reason
    assert "Fabric Manager partitions" in reason and "kept out" in reason and "PCIe GPUs" in reason
    assert report["facts"]["nvswitch_device_ids"] == ["10de:22a3"] and len(report["facts"]["nvswitch_functions"]) == 4
    assert code == 0 and report["ready"] is True  # the host can still pass other devices through
    code, table = _check(fake)
    assert code == 0 and "nvswitch" in table and CODE in table


def test_a_pcie_gpu_node_has_no_fabric_to_report(tmp_path: Path) -> None:
    code, out = _check(_hgx(tmp_path, switches=False), "--json")
    nvswitch = next(c for c in json.loads(out)["checks"] if c["name"] == "nvswitch")
    assert (code, nvswitch["status"], nvswitch["code"]) == (0, "pass", "")


def test_gpus_on_an_nvswitch_fabric_are_held_initialized_never_bound_or_advertised(tmp_path: Path) -> None:
    fake = _hgx(tmp_path / "fake")
    c = _cubelet(tmp_path, fake)
    initialize_host(c)
    for _ in range(2):
        reconcile(c)
    devs = {str(d.address): d for d in c.store.devices()}
    assert set(devs) == {g.address for g in _gpus()} | {EDU}  # the NVSwitches are never devices of ours
    gpus = [d for a, d in devs.items() if a != EDU]
    assert {(d.state, d.reason) for d in gpus} == {(S.INITIALIZED, CODE)}  # held: neither unhealthy nor quarantined
    assert devs[EDU].state is S.ALLOCATABLE  # the same host's other devices are served
    assert not [w for w in fake.write_log() if "/0000:" in w and EDU not in w]  # no GPU rebound to vfio-pci
    body = heartbeat_body(c, "http://127.0.0.1:1")
    assert body["ready"] is True and body["capacity"]["allocatable"] == 1
    assert body["capacity"]["unavailable_reasons"] == {CODE: 8}
    try:
        c.reserve("sb-gpu", ReservationRequest(accel_class="gpu"))
        raise AssertionError("a GPU on an unmanaged NVSwitch fabric was reserved")
    except CubeError as e:
        assert e.code == "reserve.insufficient_devices"
    kinds = [e.kind for e in c.store.events(0, 10000) if e.kind == "reconcile_repair"]
    assert kinds == []  # holding them back is the normal path, not a repair


def test_gpus_already_allocatable_go_back_to_initialized_when_the_fabric_is_seen(tmp_path: Path) -> None:
    """A node that served GPUs under a release without this check: on upgrade they are taken back, not failed."""
    fake = _hgx(tmp_path / "fake", switches=False)
    c = _cubelet(tmp_path, fake)
    initialize_host(c)
    gpu = _gpus()[0].address
    assert next(d for d in c.store.devices() if str(d.address) == gpu).state is S.ALLOCATABLE
    for sw in _switches():
        fake.add_device(sw)
    reconcile(c)
    d = next(d for d in c.store.devices() if str(d.address) == gpu)
    assert (d.state, d.reason) == (S.INITIALIZED, CODE)
    moved = [e for e in c.store.events(0, 10000) if e.device_id == d.id and e.event == "host_not_ready"]
    assert moved and moved[-1].reason == CODE


def _fn(device: int, cls: int) -> PciFunction:
    return PciFunction(PciAddress(0, 7, 0, 0), 0x10DE, device, class_code=cls)


def test_nvswitches_are_recognised_by_vendor_and_class_not_by_an_id_list() -> None:
    assert nvidia.is_nvswitch(_fn(0x22A3, 0x068000))  # HGX H100
    assert nvidia.is_nvswitch(_fn(0x1AF1, 0x068000))  # HGX A100
    assert nvidia.is_nvswitch(_fn(0x2FFF, 0x068000))  # a generation this release has never heard of
    assert not nvidia.is_nvswitch(_fn(0x0269, 0x068000))  # an nForce chipset's Ethernet, same class
    assert not nvidia.is_nvswitch(_fn(0x22A3, 0x040300))  # an NVIDIA audio function
    assert not nvidia.is_nvswitch(PciFunction(PciAddress(0, 7, 0, 0), 0x15B3, 0x22A3, class_code=0x068000))
    gpu = _fn(0x2330, 0x030200)
    assert nvidia.Fabric.of([gpu]).problem(gpu) is None
    p = nvidia.Fabric.of([gpu, _fn(0x2FFF, 0x068000)]).problem(gpu)
    assert p is not None and (p.code, p.held, p.hard) == (CODE, True, False)


def test_a_simulated_hgx_node_holds_its_gpus_and_advertises_none(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "h100sxmx2,2xnvswitch")
    assert {(d.state, d.reason) for d in node.devices()} == {(S.INITIALIZED, CODE)}  # the switches are not devices
    assert len(node.devices()) == 2 and not node.host.writes()  # nothing rebound to vfio-pci
    body = heartbeat_body(node.cubelet, "http://127.0.0.1:1")
    assert body["capacity"]["allocatable"] == 0 and body["capacity"]["unavailable_reasons"] == {CODE: 2}


def test_a_gpu_in_use_when_the_fabric_is_seen_is_released_as_usual_then_held(tmp_path: Path) -> None:
    """The tenant keeps its GPU until its sandbox ends; then the whole release runs (reset, scrub) and the GPU
    lands in `initialized` with the reason, not `allocatable` and not quarantined."""
    node = Node.create(tmp_path, "h100x2")
    [used] = node.cubelet.reserve("sb", ReservationRequest()).device_ids
    node.cubelet.start("sb")
    node.host.add_function("nvswitch")
    reconcile(node.cubelet)
    idle = next(d for d in node.devices() if d.id != used)
    assert (idle.state, idle.reason) == (S.INITIALIZED, CODE)
    assert node.device(used).state is S.ATTACHED  # never torn down for it
    node.cubelet.release("sb")
    d = node.device(used)
    assert (d.state, d.reason, d.sandbox_id) == (S.INITIALIZED, CODE, None)
    assert node.host.reset_count(d.address) == 2  # the tenant's release ran in full first
