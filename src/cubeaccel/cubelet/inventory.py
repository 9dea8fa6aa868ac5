"""Host initialization: host readiness → discover → `initialized` → prepare host binding → validate →
`allocatable`. On a host that is not ready devices are registered and stay `initialized` (host_ready.py); so do
devices whose scrub VM's image is not here (scrub_ready.py)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from cubeaccel.backends.base import HostBinding, Problem
from cubeaccel.cubelet import host_ready, scrub_ready
from cubeaccel.cubelet.ports import Inventory, NodeInit
from cubeaccel.cubelet.release import record_problems
from cubeaccel.model.device import DiscoveredDevice
from cubeaccel.model.states import Actor, DeviceEvent, DeviceState


def register_new(cubelet: Inventory, discovered: list[DiscoveredDevice]) -> list[str]:
    """Insert devices the store has never seen, as `initialized`. Known devices are reconcile's job."""
    new = []
    binding = cubelet.capabilities.binding
    expected = binding.expected_driver if binding is not None else None
    with cubelet.change() as t:
        for d in discovered:
            if t.device(d.device_id) is None:
                t.insert_device(d, expected, Actor.CUBELET)
                new.append(d.device_id)
    return new


def validate_initialized(cubelet: Inventory, discovered: list[DiscoveredDevice]) -> None:
    """Bind what the backend needs bound, then validate each `initialized` device — only on a ready host:
    nothing is bound to vfio-pci (or handed out) where passthrough cannot work."""
    with cubelet.store.read() as t:
        if not host_ready.current(t).ready:
            return
    by_id = {d.device_id: d for d in discovered}
    binding = cubelet.capabilities.binding  # VFIO binds to vfio-pci here; emulated has nothing to bind
    with host_pass(cubelet):  # inside a pass already (host init, reconcile), or one of its own (operator's enable)
        _validate_each(cubelet, by_id, binding)


def _validate_each(cubelet: Inventory, by_id: dict[str, DiscoveredDevice], binding: HostBinding | None) -> None:
    for rec in cubelet.store.devices():
        if rec.state is not DeviceState.INITIALIZED:
            continue
        with cubelet.device_locks.hold(rec.id):  # binding and validation are host I/O: no lifecycle lock
            problems: list[Problem] = []
            original: tuple[str | None] | None = None
            refused = cubelet.scrub_refusal(rec)  # no scrub method or image under trusted-vm: never bound or touched
            if refused is not None:
                problems = [refused]
            elif binding is not None and rec.id in by_id:
                prep = binding.prepare(by_id[rec.id])
                problems = list(prep.problems)
                if prep.changed:
                    original = (prep.original_driver,)
            if not problems:
                problems = cubelet.backend.validate(rec)
            with cubelet.change() as t:
                cur = t.device(rec.id)
                if cur is None or cur.state is not DeviceState.INITIALIZED:
                    continue
                if original is not None:
                    t.set_original_driver(cur.id, original[0])
                if problems:
                    record_problems(t, cur, problems)
                else:
                    t.transition(cur, DeviceEvent.VALIDATED, Actor.CUBELET)


def host_pass(cubelet: Inventory) -> AbstractContextManager[None]:
    """The pass reads the host once (its function list, each function, group and config space), where the backend
    can: without it every device's checks would list the whole bus again."""
    snaps = cubelet.capabilities.snapshots
    return snaps.snapshot() if snaps is not None else nullcontext()


def initialize_host(cubelet: NodeInit) -> list[DiscoveredDevice]:
    from cubeaccel.cubelet import backend_facts

    backend_facts.seed(cubelet)  # before any validation compares against them
    with host_pass(cubelet):
        discovered = cubelet.backend.discover()
        register_new(cubelet, discovered)
        host_ready.check(cubelet)  # before anything is bound, validated or advertised
        scrub_ready.reclassify_legacy(cubelet)  # an older release's quarantines for a missing image: retried
        scrub_ready.check(cubelet)  # a device its scrub VM could not clear after a tenant is held before one
        validate_initialized(cubelet, discovered)
    backend_facts.persist(cubelet)
    return discovered
