"""Facts a backend learns about devices that must survive a Cubelet restart (today: AER baselines).

Backends keep them in memory while they run; Cubelet persists them in its store after every reconcile
and seeds a fresh backend from the store at startup, so "nothing a restart needs is kept only in memory".
"""

from __future__ import annotations

from collections.abc import Callable

from cubeaccel.cubelet.lifecycle import Cubelet
from cubeaccel.model.device import PciAddress


def seed(cubelet: Cubelet) -> None:
    setter: Callable[[PciAddress, int], None] | None = getattr(cubelet.backend, "set_aer_baseline", None)
    if setter is None:
        return
    with cubelet.store.read() as t:
        stored = t.aer_baselines()
        for d in t.devices():
            if d.id in stored:
                setter(d.address, stored[d.id])


def persist(cubelet: Cubelet) -> None:
    getter: Callable[[], dict[PciAddress, int]] | None = getattr(cubelet.backend, "aer_baselines", None)
    if getter is None:
        return
    known = getter()
    with cubelet.store.tx() as t:
        stored = t.aer_baselines()
        for d in t.devices():
            count = known.get(d.address)
            if count is not None and stored.get(d.id) != count:
                t.set_aer_baseline(d.id, count)
