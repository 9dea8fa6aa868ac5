"""Facts a backend learns about devices that must survive a Cubelet restart (today: AER baselines).

Backends keep them in memory while they run; Cubelet persists them in its store after every reconcile
and seeds a fresh backend from the store at startup, so "nothing a restart needs is kept only in memory".
"""

from __future__ import annotations

from cubeaccel.cubelet.ports import AerFacts


def seed(cubelet: AerFacts) -> None:
    aer = cubelet.capabilities.aer
    if aer is None:
        return
    with cubelet.store.read() as t:
        stored = t.aer_baselines()
        for d in t.devices():
            if d.id in stored:
                aer.set_aer_baseline(d.address, stored[d.id])


def persist(cubelet: AerFacts) -> None:
    aer = cubelet.capabilities.aer
    if aer is None:
        return
    known = aer.aer_baselines()
    with cubelet.store.tx() as t:
        stored = t.aer_baselines()
        for d in t.devices():
            count = known.get(d.address)
            if count is not None and stored.get(d.id) != count:
                t.set_aer_baseline(d.id, count)
