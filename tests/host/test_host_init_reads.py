"""Host initialization reads the host's PCI function list a fixed number of times per pass, however many GPUs
the node has: the NVSwitch hold's host-wide fact, discovery and every group walk share one listing, and binding a
device to vfio-pci re-reads that device, not the bus. Counted on a fake sysfs tree through the real sysfs code."""

from __future__ import annotations

from pathlib import Path

import pytest

from cubeaccel.backends.vfio import VfioBackend
from cubeaccel.cubelet.inventory import initialize_host
from cubeaccel.cubelet.lifecycle import Cubelet, CubeletConfig
from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.cubelet.runtime import assemble
from cubeaccel.cubelet.store import Store
from cubeaccel.host.pci.base import PciFunction
from cubeaccel.host.pci.readiness import HostRoots
from cubeaccel.host.pci.sysfs import SysfsPciHost
from cubeaccel.model.states import DeviceState
from tests.support.fake_sysfs import Dev, FakeSysfs


class ListingCounter(SysfsPciHost):
    """The real sysfs code, counting how often the whole function list is enumerated."""

    listings = 0

    def functions(self) -> list[PciFunction]:
        self.listings += 1
        return super().functions()


def _gpus(n: int) -> list[Dev]:
    """Half bound to nvidia (the first start binds them to vfio-pci), half already on vfio-pci."""
    return [
        Dev(
            f"0000:{0x10 + i // 8:02x}:{i % 8:02x}.0",
            iommu_group=10 + i,
            driver="nvidia" if i % 2 else "vfio-pci",
            serial=0x1000 + i,
        )
        for i in range(n)
    ]


def _node(tmp: Path, fake: FakeSysfs) -> tuple[Cubelet, ListingCounter]:
    host = ListingCounter(fake.sys, proc_root=fake.proc, dev_root=fake.dev, on_write=fake.kernel)
    backend = VfioBackend(host, allow=("10de:*",), readiness_roots=HostRoots(fake.sys, fake.dev, fake.proc))
    cfg = CubeletConfig(pinnable_memory_mib=4096)
    return assemble(Store(tmp / "cubelet.db"), backend, ProcessShimDriver(tmp), cfg), host


def _listings(tmp: Path, n: int) -> tuple[int, int, int]:
    """(first start, restart, one reconcile pass): the listings each took on a node of `n` GPUs."""
    fake = FakeSysfs.build(tmp / "fake", _gpus(n))
    first, host = _node(tmp, fake)
    initialize_host(first)
    assert {d.state for d in first.store.devices()} == {DeviceState.ALLOCATABLE}
    assert len(first.store.devices()) == n
    at_first = host.listings
    first.store.close()
    again, host = _node(tmp, fake)  # a restart: same journal, same hardware, a fresh process
    initialize_host(again)
    at_restart = host.listings
    host.listings = 0
    assert reconcile(again) == []
    return at_first, at_restart, host.listings


@pytest.mark.parametrize("n", [4, 24])
def test_host_init_lists_the_host_once_per_pass_however_many_gpus(tmp_path: Path, n: int) -> None:
    # discovery, every group walk and the NVSwitch hold of every device (in prepare and in validate) share one
    # listing; binding half of the GPUs to vfio-pci re-reads those GPUs, not the bus
    assert _listings(tmp_path, n) == (1, 1, 1)  # (first start, restart, a reconcile pass)
