"""Which BAR layouts a template snapshot's machine is shaped for: one rule for a sandbox's start and for the
snapshots a node prepares ahead of it, so the two machines (and so their template keys) are the same.

A template start shapes every root port for the widest of `template_bars` and of its own devices
(`bars.uniform_shape`). With a contract, `template_bars` are the layouts of every device on the node the
contract admits (any state: one snapshot fits whichever device a sandbox gets), so a node prepares one machine
per template. Without one, they are the sandbox's own devices' layouts, so the machine depends on which devices
it got: the node prepares one per widest port its devices can give (none, each layout, and each pair of layouts,
since the widest of any set is the widest of at most two of them, one per window).

Pure: the Cubelet hands the node's device records in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cubeaccel.model.bars import Bar, PortShape, port_shape, widest_port
from cubeaccel.model.contract import CompatibilityContract, check_device
from cubeaccel.model.device import DeviceRecord

Layout = tuple[Bar, ...]
MAX_LAYOUTS = 64  # what a shim spec carries (wire/shim_spec.py `template_bars`)


def widest_first(bars: Layout) -> tuple[int, int]:
    """Widest port first, so a node with more layouts than a spec carries keeps the one that matters."""
    shape = port_shape(bars)
    return (-shape.pref64_bytes, -shape.mem32_bytes)


def distinct_layouts(devices: Iterable[DeviceRecord]) -> tuple[Layout, ...]:
    return tuple(sorted({d.identity.bars for d in devices if d.identity.bars}, key=widest_first))[:MAX_LAYOUTS]


def template_bars(
    contract: CompatibilityContract | None, node: Iterable[DeviceRecord], own: Sequence[DeviceRecord]
) -> tuple[Layout, ...]:
    """A sandbox's `template_bars`: the node's devices its contract admits, else (no contract, or none admitted)
    its own devices."""
    admitted = [d for d in node if contract is not None and not check_device(contract, d)] or list(own)
    return distinct_layouts(admitted)


def snapshot_layouts(contract: CompatibilityContract | None, node: Sequence[DeviceRecord]) -> list[tuple[Layout, ...]]:
    """The `template_bars` of each snapshot the node prepares so that every start of this contract (None: of a
    sandbox without one) finds its machine: one per distinct machine, narrowest first."""
    if contract is not None:
        return [template_bars(contract, node, ())]
    layouts = distinct_layouts(node)
    candidates: list[tuple[Layout, ...]] = [()]  # a sandbox with no device
    candidates += [(a,) for a in layouts]
    candidates += [(a, b) for i, a in enumerate(layouts) for b in layouts[i + 1 :]]
    out: dict[PortShape, tuple[Layout, ...]] = {}
    for c in candidates:
        out.setdefault(widest_port(c), c)
    return sorted(out.values(), key=lambda c: (widest_port(c).pref64_bytes, widest_port(c).mem32_bytes))
