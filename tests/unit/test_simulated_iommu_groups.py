"""The simulated host's IOMMU group listing is what its bus says: the group members `functions()` shows,
under any mix of faults (a vanished function, a group made unviable by a companion audio function)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.host.pci.simulated import Fault, SimulatedPciHost

HOST = "2xh100,2xt4"


@settings(max_examples=60, deadline=None)
@given(faults=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(list(Fault))), max_size=8))
def test_group_members_match_the_functions_on_the_bus(faults: list[tuple[int, Fault]]) -> None:
    host = SimulatedPciHost(HOST)
    gpus = [f.address for f in host.functions()]
    for i, fault in faults:
        host.inject(fault, gpus[i])
    on_bus = host.functions()
    for group in {f.iommu_group for f in on_bus if f.iommu_group is not None} | {999}:
        assert host.iommu_group_members(group) == [f.address for f in on_bus if f.iommu_group == group]
    vanished = {gpus[i] for i, fault in faults if fault is Fault.VANISH}
    assert not vanished & {
        a for f in on_bus if f.iommu_group is not None for a in host.iommu_group_members(f.iommu_group)
    }
