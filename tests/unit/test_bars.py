"""BARs from sysfs `resource`, the machine shaped for them, and the guest's proof that it placed them."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.backends.emulated import EmulatedBackend, pci_testdev_identity
from cubeaccel.model.bars import (
    DEFAULT_HOLE64,
    DEFAULT_MEM32_WINDOW,
    DEFAULT_PHYS_BITS,
    DEFAULT_PREF64_WINDOW,
    GIB,
    MIB,
    Bar,
    BarKind,
    PortShape,
    machine_shape,
    parse_resource,
    port_shape,
    unassigned_bars,
    uniform_shape,
)

MEM64_PREF = 0x14220C  # IORESOURCE_MEM_64 | SIZEALIGN | PREFETCH | MEM, as the kernel prints it
MEM32 = 0x40200
IO = 0x40101
ZERO = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"

# An H200 as its host kernel prints it (BAR1 = 256 GiB, the project's own evidence), then ROM and bridge lines.
H200 = (
    "0x00000000ac000000 0x00000000acffffff 0x0000000000040200\n"
    "0x0000220000000000 0x0000223fffffffff 0x000000000014220c\n" + ZERO + "0x0000224000000000 0x0000224001ffffff "
    "0x000000000014220c\n" + ZERO + "0x0000000000003000 0x000000000000307f 0x0000000000040101\n" + ZERO * 7
)


def _line(start: int, size: int, flags: int) -> str:
    return f"0x{start:016x} 0x{start + size - 1:016x} 0x{flags:016x}\n" if size else ZERO


def test_an_h200_resource_file_gives_its_bars_with_kind_and_prefetch() -> None:
    assert parse_resource(H200) == (
        Bar(0, 16 * MIB, BarKind.MEM32),
        Bar(1, 256 * GIB, BarKind.MEM64, prefetch=True),
        Bar(3, 32 * MIB, BarKind.MEM64, prefetch=True),
        Bar(5, 128, BarKind.IO),
    )


def test_a_resource_file_the_kernel_would_not_print_is_no_bars_rather_than_a_guess() -> None:
    assert parse_resource(None) == ()
    assert parse_resource("0x0 0xfff\n") == ()
    assert parse_resource("0x00 0xzz 0x200\n") == ()
    assert parse_resource("12 4095 512\n") == ()


bars_st = st.lists(
    st.tuples(st.integers(12, 40), st.sampled_from([(MEM64_PREF, BarKind.MEM64, True), (MEM32, BarKind.MEM32, False)])),
    min_size=1,
    max_size=6,
)


@given(bars_st)
def test_parsing_what_the_kernel_prints_gives_back_each_bar_at_its_index(spec: list[tuple[int, Any]]) -> None:
    text = "".join(_line((1 << 44) + i * (1 << 41), 1 << shift, flags) for i, (shift, (flags, _, _)) in enumerate(spec))
    expected = tuple(Bar(i, 1 << shift, kind, pref) for i, (shift, (_, kind, pref)) in enumerate(spec))
    assert parse_resource(text + ZERO * 7) == expected


def test_a_machine_with_no_device_that_asks_more_keeps_todays_shape() -> None:
    shape = machine_shape([], 4, 256)
    assert shape.ports == (PortShape(DEFAULT_PREF64_WINDOW, DEFAULT_MEM32_WINDOW),) * 4
    assert (shape.hole64_bytes, shape.phys_bits) == (DEFAULT_HOLE64, DEFAULT_PHYS_BITS)
    edu = (Bar(0, MIB, BarKind.MEM32),)
    assert machine_shape([edu, edu], 4, 256) == shape == uniform_shape([edu], 4, 256)


def test_an_h200_gets_a_window_that_holds_its_aperture_wherever_firmware_puts_it() -> None:
    bars = parse_resource(H200)
    port = port_shape(bars)
    assert port.pref64_bytes == 1 << 40  # 256 GiB + 32 MiB → 512 GiB, twice for alignment
    assert port.mem32_bytes == 32 * MIB
    shape = machine_shape([bars] * 8, 8, 64 * 1024)
    assert shape.hole64_bytes >= 8 * port.pref64_bytes
    assert 1 << shape.phys_bits >= 4 * GIB + 64 * GIB + shape.hole64_bytes


@given(st.lists(st.integers(12, 44), min_size=1, max_size=4), st.integers(0, 1 << 20))
def test_a_port_window_holds_its_bars_aligned_at_any_1_mib_aligned_base(shifts: list[int], base_mib: int) -> None:
    """Firmware aligns an empty hot-plug window to 1 MiB only: the window must still hold every BAR at a multiple
    of its size, packed largest first."""
    bars = [Bar(i, 1 << s, BarKind.MEM64, prefetch=True) for i, s in enumerate(shifts)]
    window = port_shape(bars).pref64_bytes
    start, end = base_mib * MIB, base_mib * MIB + window
    at = start
    for b in sorted(bars, key=lambda b: -b.size):
        at = (at + b.size - 1) // b.size * b.size
        at += b.size
    assert at <= end
    assert window & (window - 1) == 0  # a power of two


@given(
    st.lists(st.lists(st.integers(12, 42), min_size=0, max_size=3), min_size=0, max_size=8),
    st.integers(64, 1 << 20),
)
def test_the_hole_holds_every_window_and_the_address_bits_reach_its_end(ports: list[list[int]], mib: int) -> None:
    bars = [[Bar(i, 1 << s, BarKind.MEM64, prefetch=True) for i, s in enumerate(p)] for p in ports]
    shape = machine_shape(bars, 8, mib)
    assert len(shape.ports) == 8
    assert shape.hole64_bytes >= sum(p.pref64_bytes for p in shape.ports) + GIB
    assert shape.hole64_bytes >= DEFAULT_HOLE64
    hole_start_max = 4 * GIB + (mib * MIB + GIB - 1) // GIB * GIB + GIB
    assert hole_start_max + shape.hole64_bytes <= 1 << shape.phys_bits
    uniform = uniform_shape(bars, 8, mib)
    assert all(u.pref64_bytes >= p.pref64_bytes for u in uniform.ports for p in shape.ports)


def test_guest_resource_shows_every_bar_placed_at_its_size() -> None:
    want = pci_testdev_identity(64 * GIB).bars
    guest = _line(0xFE800000, 4096, MEM32) + _line(0x1000, 256, IO) + _line(64 * GIB, 64 * GIB, MEM64_PREF)
    assert unassigned_bars(want, guest + ZERO * 10) == []


def test_a_bar_the_guest_found_no_room_for_is_named_and_io_bars_are_not_held_against_it() -> None:
    want = pci_testdev_identity(64 * GIB).bars
    guest = _line(0xFE800000, 4096, MEM32) + ZERO + ZERO + ZERO * 10  # BAR2 reset to zeros, no I/O space either
    (miss,) = unassigned_bars(want, guest)
    assert miss.bar.index == 2 and miss.found_size == 0 and "no room" in miss.reason
    assert miss.to_json()["bar"] == "BAR2"


def test_a_bar_not_yet_placed_or_placed_smaller_is_not_placed() -> None:
    want = (Bar(2, 64 * GIB, BarKind.MEM64, prefetch=True),)
    unset = _line(0, 64 * GIB, MEM64_PREF | 0x20000000)  # sized, not placed yet (IORESOURCE_UNSET)
    assert [m.bar.index for m in unassigned_bars(want, ZERO * 2 + unset)] == [2]
    smaller = _line(64 * GIB, 2 * GIB, MEM64_PREF)
    (miss,) = unassigned_bars(want, ZERO * 2 + smaller)
    assert miss.found_size == 2 * GIB and "2 GiB" in miss.reason
    assert [m.bar.index for m in unassigned_bars(want, None)] == [2]


def test_the_emulated_gpu_stand_in_is_discovered_with_its_bars_beside_edu() -> None:
    backend = EmulatedBackend("barstest", slots=1, qemu="/bin/true", testdev_membars=(64 * GIB,))
    edu, testdev = backend.discover()
    assert edu.identity.bars == (Bar(0, MIB, BarKind.MEM32),)
    assert testdev.identity.vendor_device == "1b36:0005" and testdev.labels["model"] == "pci-testdev"
    assert Bar(2, 64 * GIB, BarKind.MEM64, prefetch=True) in testdev.identity.bars
