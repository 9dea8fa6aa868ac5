"""A warm pool whose template has a newer version is superseded (docs/warm.md): setting the new version's pool
drops the old one and releases its unclaimed warm sandboxes at once, so none keeps a device or pinned memory that
no create can claim, and the new pool refills from the new document. A real Cubelet and SQLite store on
simulated devices."""

from __future__ import annotations

import dataclasses

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.warm import SUPERSEDED, supersedes
from cubeaccel.model.contract import CompatibilityContract, freeze
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.model.states import DeviceState
from tests.support.contract_builders import template
from tests.support.cubelet_harness import Node
from tests.support.poll import poll

P = ReservationPhase
V1 = freeze(template(spec__memory__size_mib=1024))
V2 = freeze(template(spec__memory__size_mib=1024, metadata__version="2"))


def shape(contract: CompatibilityContract, vcpus: int = 1) -> ReservationRequest:
    return ReservationRequest(
        count=1, accel_class="gpu", template=contract.template_name, contract=contract, memory_mib=1024, vcpus=vcpus
    )


def warm_ids(node: Node, key: str) -> list[str]:
    return [
        r.sandbox_id
        for r in node.cubelet.store.reservations()
        if r.checkpoint.warm_pool == key and r.phase is P.WARM and r.checkpoint.claimed_at is None
    ]


def fill(node: Node, req: ReservationRequest, size: int) -> str:
    pool = node.cubelet.warm.set_pool(req, size)

    def full() -> bool:
        node.cubelet.warm.refill_once()  # starts what the pool lacks, within the bound on concurrent starts
        return len(warm_ids(node, pool.key)) == size

    poll(full, 20)
    return pool.key


def test_a_new_template_version_supersedes_the_pool_and_releases_its_warm_sandboxes(node: Node) -> None:
    old_key = fill(node, shape(V1), 2)
    old_ids = warm_ids(node, old_key)

    new_key = fill(node, shape(V2), 2)
    assert list(node.cubelet.warm.pools) == [new_key]  # the old pool is gone, from the journal too
    poll(lambda: all(node.cubelet.store.reservation(sid) is None for sid in old_ids), 20)
    for sid in old_ids:  # released through the ordinary path, with the reason
        reasons = [
            e.reason for e in node.cubelet.store.events(0, 10000, sandbox_id=sid) if e.kind == "teardown_started"
        ]
        assert reasons == [SUPERSEDED]
    states = [d.state for d in node.devices()]
    assert (states.count(DeviceState.ATTACHED), states.count(DeviceState.ALLOCATABLE)) == (2, 6)  # the new pool's
    assert [(v.key, v.warm) for v in node.cubelet.warm.views()] == [(new_key, 2)]
    node.restart()
    assert list(node.cubelet.warm.pools) == [new_key]
    claimed, _, _ = node.cubelet.warm.claim("sb-1", dataclasses.replace(shape(V2), tenant="acme"))
    assert claimed.params.contract is not None and claimed.params.contract.digest == V2.digest


def test_another_shape_or_another_template_is_not_superseded() -> None:
    assert supersedes(shape(V2), shape(V1)) and supersedes(shape(V1), shape(V2))
    assert not supersedes(shape(V1), shape(V1))  # the same document: the same pool, resized
    assert not supersedes(shape(V2, vcpus=2), shape(V1))  # two shapes of one template are two pools
    other = freeze(template(spec__memory__size_mib=1024, metadata__name="other"))
    assert not supersedes(shape(other), shape(V1))
    assert not supersedes(ReservationRequest(count=1, template="cuda12-h100"), shape(V1))  # no contract
