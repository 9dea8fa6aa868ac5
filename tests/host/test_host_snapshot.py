"""A reconcile pass reads the host once: each function, group walk and config space once per pass, however many
devices; a write inside the pass (bind, reset) is never answered from before it."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.host.pci.simulated import Fault, SimulatedPciHost
from cubeaccel.host.pci.snapshot import SnapshotHost
from cubeaccel.model.device import PciAddress
from cubeaccel.model.states import DeviceState
from tests.support.cubelet_harness import Node


class Counting:
    """Counts the reads that reach the real (simulated) host."""

    def __init__(self, host: SimulatedPciHost) -> None:
        self.host = host
        self.calls: Counter[str] = Counter()
        self.per_address: Counter[tuple[str, str]] = Counter()
        for name in ("functions", "function", "iommu_group_members", "config_vendor_id", "holders"):
            setattr(host, name, self._wrap(name, getattr(host, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        def counted(*args: Any) -> Any:
            self.calls[name] += 1
            if args:
                self.per_address[(name, str(args[0]))] += 1
            return fn(*args)

        return counted


def test_a_pass_reads_each_function_once_and_walks_the_bus_once(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "h100x8")
    counting = Counting(node.host)
    assert reconcile(node.cubelet) == []
    assert counting.calls["functions"] == 1  # discovery and every group walk share one listing
    assert counting.calls["function"] == 0 and counting.calls["iommu_group_members"] == 0
    reads = [n for (name, _), n in counting.per_address.items() if name in ("config_vendor_id", "holders")]
    assert len(reads) == 16 and max(reads) == 1  # 8 devices, config space and holders, once each
    counting.calls.clear()
    assert reconcile(node.cubelet) == []
    assert counting.calls["functions"] == 1  # the next pass takes a new snapshot: nothing carried over


def test_a_fault_appearing_between_passes_is_seen_by_the_next_pass(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "h100x2")
    assert reconcile(node.cubelet) == []
    node.host.inject(Fault.HEALTH_FAIL, PciAddress.parse("0000:10:00.0"))
    reconcile(node.cubelet)
    assert node.device("vfio-0000:10:00.0").state is DeviceState.UNHEALTHY
    assert node.device("vfio-0000:11:00.0").state is DeviceState.ALLOCATABLE


def test_a_write_drops_the_snapshot(tmp_path: Path) -> None:
    host = SimulatedPciHost("h100x2", tmp_path / "host.json")
    snap = SnapshotHost(host)
    addr = PciAddress.parse("0000:10:00.0")
    f = snap.function(addr)
    assert f is not None and f.driver == "nvidia"
    snap.bind(addr, "vfio-pci")
    after = snap.function(addr)
    assert after is not None and after.driver == "vfio-pci"
    before_reset = snap.config_vendor_id(addr)
    host.inject(Fault.HEALTH_FAIL, addr)
    assert snap.config_vendor_id(addr) == before_reset  # inside the pass: the snapshot's answer
    snap.reset(addr)
    assert snap.config_vendor_id(addr) == 0xFFFF  # after a write: read again


def test_a_bind_rereads_the_bound_function_and_keeps_the_rest_of_the_pass(tmp_path: Path) -> None:
    """Host initialization binds every new device inside one pass: the bus is not listed again for each."""
    host = SimulatedPciHost("h100x2", tmp_path / "host.json")
    counting = Counting(host)
    snap = SnapshotHost(host)
    bound, other = PciAddress.parse("0000:10:00.0"), PciAddress.parse("0000:11:00.0")
    assert {f.driver for f in snap.functions()} == {"nvidia"}
    before = snap.config_vendor_id(other)
    host.inject(Fault.HEALTH_FAIL, other)
    snap.bind(bound, "vfio-pci")
    drivers = {f.address: f.driver for f in snap.functions()}
    assert drivers == {bound: "vfio-pci", other: "nvidia"}  # the listing shows the bind
    f = snap.function(bound)
    assert f is not None and f.driver == "vfio-pci"
    assert snap.config_vendor_id(other) == before  # the other device's answers are the pass's
    assert counting.calls["functions"] == 1 and counting.per_address[("function", str(bound))] == 1


ADDRESSES = [PciAddress.parse(f"0000:{0x10 + i:02x}:00.0") for i in range(4)]
Op = tuple[str, int, str]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["bind", "function", "functions", "group"]),
            st.integers(0, 3),
            st.sampled_from(["vfio-pci", "nvidia"]),
        ),
        max_size=20,
    )
)
def test_after_any_binds_the_pass_answers_as_the_host_does(tmp_path: Path, ops: list[Op]) -> None:
    """Binds inside a pass re-read only what they wrote; whatever mix of reads and binds, every answer the pass
    gives equals the host's own at that moment (nothing else changes the host meanwhile)."""
    host = SimulatedPciHost("h100x4", tmp_path / f"host-{uuid.uuid4().hex}.json")
    snap = SnapshotHost(host)
    for name, i, driver in ops:
        address = ADDRESSES[i]
        if name == "bind":
            snap.bind(address, driver)
        elif name == "function":
            assert snap.function(address) == host.function(address)
        elif name == "functions":
            assert snap.functions() == host.functions()
        else:
            f = host.function(address)
            assert f is not None and f.iommu_group is not None
            assert snap.iommu_group_members(f.iommu_group) == host.iommu_group_members(f.iommu_group)
    assert snap.functions() == host.functions()
