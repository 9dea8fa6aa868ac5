"""The snapshots a node prepares cover every machine a template start can have there (model/snapshot_layouts.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.model.bars import GIB, MIB, Bar, BarKind, uniform_shape
from cubeaccel.model.device import AcceleratorClass, DeviceIdentity, DeviceRecord, PciAddress
from cubeaccel.model.snapshot_layouts import snapshot_layouts, template_bars
from cubeaccel.model.states import DeviceState
from cubeaccel.wire.shim_spec import MAX_DEVICES

EDU = (Bar(0, MIB, BarKind.MEM32),)
TESTDEV_64G = (Bar(0, 4096, BarKind.MEM32), Bar(1, 256, BarKind.IO), Bar(2, 64 * GIB, BarKind.MEM64, prefetch=True))
H100 = (Bar(0, 16 * MIB, BarKind.MEM32), Bar(1, 128 * GIB, BarKind.MEM64, prefetch=True))
WIDE_MMIO = (Bar(0, 64 * MIB, BarKind.MEM32),)  # a wider non-prefetchable window, narrow prefetchable one
LAYOUTS = [(), EDU, TESTDEV_64G, H100, WIDE_MMIO]


def _device(i: int, bars: tuple[Bar, ...]) -> DeviceRecord:
    return DeviceRecord(
        id=f"dev-{i}",
        address=PciAddress(0, 0xE0, i, 0),
        identity=DeviceIdentity(vendor_id=0x1B36, device_id=0x0005, bars=bars),
        accel_class=AcceleratorClass.GPU,
        backend="emulated",
        numa_node=-1,
        iommu_group=None,
        expected_driver=None,
        labels={},
        state=DeviceState.ALLOCATABLE,
        generation=0,
        reason=None,
        sandbox_id=None,
        updated_at=0.0,
    )


def _machine(layouts: tuple[tuple[Bar, ...], ...], memory_mib: int = 256) -> object:
    return uniform_shape(layouts, MAX_DEVICES, memory_mib)


@given(
    node_layouts=st.lists(st.sampled_from(LAYOUTS), min_size=1, max_size=8),
    picks=st.lists(st.integers(0, 7), min_size=0, max_size=4, unique=True),
)
def test_every_start_without_a_template_finds_a_prepared_machine(
    node_layouts: list[tuple[Bar, ...]], picks: list[int]
) -> None:
    """Whichever of the node's devices a sandbox gets (none, one, several), its template start's machine — the
    widest of its own devices, as the shim shapes it — is one the node prepared."""
    node = [_device(i, b) for i, b in enumerate(node_layouts)]
    own = [node[i] for i in picks if i < len(node)]
    bars = template_bars(None, node, own)
    start = _machine((*bars, *(d.identity.bars for d in own)))
    prepared = {repr(_machine(p)) for p in snapshot_layouts(None, node)}
    assert repr(start) in prepared


def test_a_node_of_one_layout_prepares_two_machines_and_of_none_one() -> None:
    assert snapshot_layouts(None, [_device(0, EDU)]) == [()]  # edu's windows are the default ones
    assert snapshot_layouts(None, []) == [()]
    two = snapshot_layouts(None, [_device(0, EDU), _device(1, TESTDEV_64G), _device(2, TESTDEV_64G)])
    assert two == [(), (TESTDEV_64G,)]


def test_a_wide_prefetchable_and_a_wide_mmio_device_together_are_a_machine_of_their_own() -> None:
    """The widest of two devices takes each window from another one: the pair is planned as well."""
    plans = snapshot_layouts(None, [_device(0, H100), _device(1, WIDE_MMIO)])
    assert len(plans) == 4 and any(len(p) == 2 for p in plans)
