"""A PCI function's BARs, the machine shaped to receive them, and the guest's proof that it did.

Pure (no I/O): the host reads `resource` at discovery and the guest reads it after a hot-plug, and both hand the
text to `parse_resource`; the shim sizes the machine with `machine_shape` and judges the guest's reply with
`unassigned_bars`. The guest agent imports this module too, so it stays stdlib-only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# linux/ioport.h: the flags column of `resource`
IORESOURCE_IO = 0x100
IORESOURCE_MEM = 0x200
IORESOURCE_PREFETCH = 0x2000
IORESOURCE_MEM_64 = 0x100000
IORESOURCE_DISABLED = 0x10000000
IORESOURCE_UNSET = 0x20000000

BAR_COUNT = 6  # lines 0..5 of `resource`; line 6 is the expansion ROM, then bridge windows
MIB = 1 << 20
GIB = 1 << 30
# What a machine had before BARs shaped it, and still has where no device asks for more: a 2 GiB prefetchable
# window per root port, the 2 MiB non-prefetchable window firmware gives an empty hot-plug port, q35's 32 GiB
# 64-bit hole, and TCG's 40 address bits.
DEFAULT_PREF64_WINDOW = 2 * GIB
DEFAULT_MEM32_WINDOW = 2 * MIB
DEFAULT_HOLE64 = 32 * GIB
DEFAULT_PHYS_BITS = 40
MAX_PHYS_BITS = 52  # x86-64's architectural limit (QEMU refuses more)
MAX_BAR_BYTES = 1 << 48


class BarKind(StrEnum):
    MEM32 = "mem32"
    MEM64 = "mem64"
    IO = "io"


@dataclass(frozen=True, order=True)
class Bar:
    """One BAR as discovery saw it: where it must live (kind, prefetchable) and how big it is (a power of two)."""

    index: int
    size: int
    kind: BarKind
    prefetch: bool = False

    @property
    def pref64(self) -> bool:
        """Only these go in a bridge's 64-bit prefetchable window; every other memory BAR needs the 32-bit one."""
        return self.kind is BarKind.MEM64 and self.prefetch

    @property
    def name(self) -> str:
        traits = [self.kind.value] + (["prefetchable"] if self.prefetch else [])
        return f"BAR{self.index} ({', '.join(traits)}, {human_bytes(self.size)})"

    def to_json(self) -> dict[str, object]:
        return {"index": self.index, "size": self.size, "kind": self.kind.value, "prefetch": self.prefetch}

    @classmethod
    def from_json(cls, raw: Any) -> Bar:
        """Strict: a record or a spec that says something else about a BAR is wrong, not guessed at."""
        if not isinstance(raw, dict):
            raise ValueError("a BAR is an object")
        index, size, kind, prefetch = raw.get("index"), raw.get("size"), raw.get("kind"), raw.get("prefetch", False)
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < BAR_COUNT:
            raise ValueError(f"BAR index must be 0..{BAR_COUNT - 1}, got {index!r:.40}")
        if not isinstance(size, int) or isinstance(size, bool) or not is_bar_size(size):
            raise ValueError(f"BAR size must be a power of two up to 2^48 bytes, got {size!r:.40}")
        if kind not in {k.value for k in BarKind} or not isinstance(prefetch, bool):
            raise ValueError(f"BAR kind must be one of {[k.value for k in BarKind]} and prefetch a boolean")
        return cls(index, size, BarKind(kind), prefetch)


def is_bar_size(size: int) -> bool:
    return 0 < size <= MAX_BAR_BYTES and size & (size - 1) == 0


def human_bytes(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class ResourceLine:
    """One line of `resource` as the kernel printed it (start, end, flags)."""

    index: int
    start: int
    end: int
    flags: int

    @property
    def size(self) -> int:
        return self.end - self.start + 1 if self.end > self.start else 0

    @property
    def assigned(self) -> bool:
        """A memory or I/O range the kernel placed: an unplaced BAR starts at 0 (and carries UNSET), and one the
        kernel gave up on is reset to all zeros."""
        return self.size > 0 and self.start != 0 and not self.flags & (IORESOURCE_UNSET | IORESOURCE_DISABLED)

    def bar(self) -> Bar | None:
        if self.size == 0 or not self.flags & (IORESOURCE_IO | IORESOURCE_MEM):
            return None
        if self.flags & IORESOURCE_IO:
            return Bar(self.index, self.size, BarKind.IO)
        kind = BarKind.MEM64 if self.flags & IORESOURCE_MEM_64 else BarKind.MEM32
        return Bar(self.index, self.size, kind, bool(self.flags & IORESOURCE_PREFETCH))


def parse_resource_lines(text: str | None) -> tuple[ResourceLine, ...]:
    """BAR0..BAR5 of a `resource` file; () for anything the kernel would not have printed (a fact we lack)."""
    if text is None:
        return ()
    out = []
    for index, line in enumerate(text.splitlines()[:BAR_COUNT]):
        parts = line.split()
        if len(parts) != 3 or not all(p.startswith("0x") for p in parts):
            return ()
        try:
            start, end, flags = (int(p, 16) for p in parts)
        except ValueError:
            return ()
        out.append(ResourceLine(index, start, end, flags))
    return tuple(out)


def parse_resource(text: str | None) -> tuple[Bar, ...]:
    """The BARs a function has (unused ones left out). A 64-bit BAR takes two lines; the kernel prints the
    second as zeros, so each BAR appears once, at its own index."""
    return tuple(b for line in parse_resource_lines(text) if (b := line.bar()) is not None)


# ---- machine shape ---------------------------------------------------------------------------------------


def pow2_at_least(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class PortShape:
    """What one hot-plug root port reserves at boot: its prefetchable 64-bit and non-prefetchable windows."""

    pref64_bytes: int = DEFAULT_PREF64_WINDOW
    mem32_bytes: int = DEFAULT_MEM32_WINDOW


@dataclass(frozen=True)
class MachineShape:
    """The address-space side of a machine: part of its command line, so part of a template's key."""

    ports: tuple[PortShape, ...]
    hole64_bytes: int
    phys_bits: int

    def to_json(self) -> dict[str, object]:
        return {
            "ports": [[p.pref64_bytes, p.mem32_bytes] for p in self.ports],
            "hole64_bytes": self.hole64_bytes,
            "phys_bits": self.phys_bits,
        }


def port_shape(bars: Iterable[Bar]) -> PortShape:
    """Windows a port needs to take this device after boot.

    Firmware reserves an empty hot-plug window aligned only to 1 MiB, while a BAR must sit at a multiple of its
    own size. Any range twice a power of two P long holds a P-aligned block of P, and BARs packed largest first
    from there leave no gaps, so each window is twice the power of two at or above its BARs' sum (never below the
    defaults)."""
    bars = list(bars)
    pref = sum(b.size for b in bars if b.pref64)
    other = sum(b.size for b in bars if b.kind is not BarKind.IO and not b.pref64)
    return PortShape(
        max(DEFAULT_PREF64_WINDOW, 2 * pow2_at_least(pref)) if pref else DEFAULT_PREF64_WINDOW,
        max(DEFAULT_MEM32_WINDOW, 2 * pow2_at_least(other)) if other else DEFAULT_MEM32_WINDOW,
    )


def machine_shape(port_bars: Sequence[Iterable[Bar]], root_ports: int, memory_mib: int) -> MachineShape:
    """The machine for devices `port_bars[i]` in root port i (ports beyond them take the defaults)."""
    if len(port_bars) > root_ports:
        raise ValueError(f"{len(port_bars)} devices for {root_ports} root ports")
    return _around(
        tuple(port_shape(port_bars[i]) if i < len(port_bars) else PortShape() for i in range(root_ports)), memory_mib
    )


def uniform_shape(candidates: Iterable[Iterable[Bar]], root_ports: int, memory_mib: int) -> MachineShape:
    """A template's machine: every port can take the largest of `candidates` (a template state fits each of
    its sandboxes only when it does not depend on which device lands in which port)."""
    return _around((widest_port(candidates),) * root_ports, memory_mib)


def widest_port(candidates: Iterable[Iterable[Bar]]) -> PortShape:
    """The port every one of `candidates` fits: each window as wide as the widest any of them needs."""
    shapes = [port_shape(c) for c in candidates] or [PortShape()]
    return PortShape(max(s.pref64_bytes for s in shapes), max(s.mem32_bytes for s in shapes))


def _around(ports: tuple[PortShape, ...], memory_mib: int) -> MachineShape:
    """The 64-bit hole holds every port's prefetchable window (firmware packs them from the hole's start) with
    1 GiB to spare for the root complex's own 64-bit BARs, as a power of two, never below q35's default. Guest
    physical addresses must reach the hole's end, which starts at most 1 GiB past 4 GiB + the guest's RAM."""
    hole = max(DEFAULT_HOLE64, pow2_at_least(sum(p.pref64_bytes for p in ports) + GIB))
    end = 4 * GIB + (memory_mib * MIB + GIB - 1) // GIB * GIB + GIB + hole
    bits = max(DEFAULT_PHYS_BITS, (end - 1).bit_length())
    if bits > MAX_PHYS_BITS:
        raise ValueError(f"the devices' BARs need {bits} physical address bits; x86-64 has {MAX_PHYS_BITS}")
    return MachineShape(ports, hole, bits)


# ---- the guest's proof -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BarMiss:
    """A BAR the guest did not place at its size: what was expected and what the guest's `resource` says."""

    bar: Bar
    found_start: int | None
    found_size: int

    @property
    def reason(self) -> str:
        if self.found_start is None:
            return "missing from the guest's resource file"
        if self.found_size == 0:
            return "not assigned (the guest kernel found no room for it)"
        if self.found_size != self.bar.size:
            return f"assigned at {human_bytes(self.found_size)}"
        return "not assigned"

    def to_json(self) -> dict[str, object]:
        return {
            **self.bar.to_json(),
            "bar": f"BAR{self.bar.index}",
            "found_start": None if self.found_start is None else f"0x{self.found_start:x}",
            "found_size": self.found_size,
            "reason": self.reason,
        }


def unassigned_bars(expected: Iterable[Bar], guest_resource: str | None) -> list[BarMiss]:
    """Memory BARs of `expected` that the guest's `resource` does not show placed at their size (I/O BARs are
    legacy ports no accelerator driver needs; they are not held against the device)."""
    lines = {line.index: line for line in parse_resource_lines(guest_resource)}
    misses = []
    for bar in sorted(expected):
        if bar.kind is BarKind.IO:
            continue
        line = lines.get(bar.index)
        if line is None:
            misses.append(BarMiss(bar, None, 0))
        elif not line.assigned or line.size != bar.size:
            misses.append(BarMiss(bar, line.start, line.size if line.assigned else 0))
    return misses
