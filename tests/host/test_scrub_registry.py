"""The scrub-method registry (backends/scrub_methods.py): each device kind's method comes from one table, and a
device with no known method under policy `trusted-vm` is held at host initialization — never bound, never written
to, never advertised — until the operator picks a policy for it (docs/scrub.md)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from cubeaccel.backends.emulated import EDU_IDENTITY, pci_testdev_identity
from cubeaccel.backends.scrub_methods import BAR_MEMORY, CUDA, EDU_REGISTERS, NO_METHOD, VMM_EXIT, method_for
from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cubelet.heartbeat import heartbeat_body
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import Cubelet, CubeletConfig
from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.runtime import assemble
from cubeaccel.cubelet.scrub import ProcessScrubRunner, parse_policy
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.readiness import HostRoots
from cubeaccel.images.builder import cached_images
from cubeaccel.model.device import DeviceIdentity
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.error_catalog import CATALOG
from tests.support.fake_sysfs import Dev, FakeSysfs

S = DeviceState
AMD = "0000:21:00.0"  # 1002:74a1 (an Instinct MI300X): no scrub method registered
GPU = "0000:18:00.0"
EDU = "0000:05:00.0"
CPU_IMAGE = "sha256:" + "c" * 64


def _tree(base: Path) -> FakeSysfs:
    fake = FakeSysfs.build(
        base,
        [
            Dev(GPU, iommu_group=10),
            Dev(
                AMD,
                vendor=0x1002,
                device=0x74A1,
                class_code=0x120000,
                subsystem_vendor=0x1002,
                iommu_group=11,
                driver="amdgpu",
                native="amdgpu",
            ),
            Dev(
                EDU,
                vendor=0x1234,
                device=0x11E8,
                class_code=0x00FF00,
                subsystem_vendor=0x1AF4,
                iommu_group=12,
                driver=None,
                native=None,
            ),
        ],
        drivers=("nvidia", "amdgpu", "vfio-pci"),
    )
    for address in (AMD, GPU, EDU):  # what a scrub or a bind would touch: config space and the BAR files
        d = fake.devdir(address)
        (d / "config").write_bytes(bytes(range(256)))
        for i in (0, 2):
            (d / f"resource{i}").write_bytes(b"\xa5" * 4096)
    return fake


def _fingerprint(fake: FakeSysfs, address: str) -> dict[str, str]:
    d = fake.devdir(address)
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.iterdir())
        if p.is_file() and not p.is_symlink()
    } | {"driver": str((d / "driver").resolve()) if (d / "driver").exists() else ""}


def _cubelet(tmp: Path, fake: FakeSysfs, scrub: list[str]) -> Cubelet:
    backend = VfioBackend(
        fake.host(), allow=("10de:*", "1002:*", "1234:11e8"), readiness_roots=HostRoots(fake.sys, fake.dev, fake.proc)
    )
    cfg = CubeletConfig(pinnable_memory_mib=4096, scrub_policy=parse_policy(scrub))
    return assemble(Store(tmp / "cubelet.db"), backend, ProcessShimDriver(tmp), cfg)


def test_each_kind_gets_its_registered_method_and_an_unknown_one_none() -> None:
    gpu = DeviceIdentity(vendor_id=0x10DE, device_id=0x2335, class_code=0x030200)
    assert method_for(gpu) is CUDA and CUDA.image_stack == "nvidia" and CUDA.memory_mib >= 1024
    assert method_for(EDU_IDENTITY) is EDU_REGISTERS and EDU_REGISTERS.params == {"layout": "edu"}
    assert method_for(DeviceIdentity(vendor_id=0x1AF4, device_id=0x1110, class_code=0x050000)) is BAR_MEMORY
    assert method_for(pci_testdev_identity(1 << 30)) is VMM_EXIT and not VMM_EXIT.needs_vm
    # Another vendor's accelerator, and an NVIDIA function that is not a GPU (an NVSwitch): nothing guessed.
    assert method_for(DeviceIdentity(vendor_id=0x1002, device_id=0x74A1, class_code=0x120000)) is None
    assert method_for(DeviceIdentity(vendor_id=0x10DE, device_id=0x22A3, class_code=0x068000)) is None


def test_an_unknown_vendors_device_is_held_and_never_written_to_under_trusted_vm(tmp_path: Path) -> None:
    fake = _tree(tmp_path / "host")
    before = _fingerprint(fake, AMD)
    cubelet = _cubelet(tmp_path, fake, [])
    initialize_host(cubelet)
    reconcile(cubelet)
    reconcile(cubelet)
    by_addr = {str(d.address): d for d in cubelet.store.devices()}
    amd = by_addr[AMD]
    assert (amd.state, amd.reason) == (S.INITIALIZED, NO_METHOD)
    assert by_addr[GPU].state is S.ALLOCATABLE and by_addr[EDU].state is S.ALLOCATABLE  # the others are served
    # Never written to: its config space, BAR files, driver and override are as they were; no write names it.
    assert _fingerprint(fake, AMD) == before
    assert not [w for w in fake.writes if AMD in w[0] or AMD in w[1]]
    advertised = heartbeat_body(cubelet, "http://node")["capacity"]
    assert AMD not in str(advertised)
    assert NO_METHOD in CATALOG


def test_the_operators_policy_for_the_kind_lets_it_in(tmp_path: Path) -> None:
    fake = _tree(tmp_path / "host")
    cubelet = _cubelet(tmp_path, fake, ["1002:74a1=none"])
    initialize_host(cubelet)
    amd = next(d for d in cubelet.store.devices() if str(d.address) == AMD)
    assert amd.state is S.ALLOCATABLE
    assert "vfio-pci" in str((fake.devdir(AMD) / "driver").resolve())  # now it is bound, as any served device


def test_the_scrub_vm_takes_the_registry_s_method_image_and_machine(tmp_path: Path) -> None:
    fake = _tree(tmp_path / "host")
    (tmp_path / "c").mkdir()
    cubelet = _cubelet(tmp_path / "c", fake, [])
    initialize_host(cubelet)
    by_addr = {str(d.address): d for d in cubelet.store.devices()}
    runner = ProcessScrubRunner(tmp_path / "c", image_digest=CPU_IMAGE)
    edu = runner.spec("scrub-e", by_addr[EDU], cubelet.backend.attach_spec(by_addr[EDU]))
    assert (edu.scrub, edu.scrub_params, edu.memory_mib, edu.image_digest) == ("bar", {"layout": "edu"}, 256, CPU_IMAGE)
    gpu = ProcessScrubRunner(tmp_path / "c").spec("scrub-g", by_addr[GPU], cubelet.backend.attach_spec(by_addr[GPU]))
    # cuda: the NVIDIA image (never the CPU one), cold, 1 GiB, shaped for its BARs.
    assert (gpu.scrub, gpu.scrub_params, gpu.memory_mib, gpu.start) == ("cuda", {}, 1024, "cold")
    cpu_images = {m.image_digest for m in cached_images() if m.vendor is None}
    assert gpu.image_digest not in cpu_images
    assert [b.size for b in gpu.devices[0].bars if b.index == 2] == [128 << 30]
