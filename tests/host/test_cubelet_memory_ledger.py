"""The pinned-memory ledger: reservations lock guest RAM plus the VMM's overhead against the node's lockable
memory; the one that would overdraw it is refused at `pinned_memory` and changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from cubeaccel.cubelet.heartbeat import heartbeat_body
from cubeaccel.cubelet.lifecycle import CubeletConfig, ReservationRequest
from cubeaccel.cubelet.memory_ledger import VmmHost, ledger
from cubeaccel.cubelet.store import Reservation
from cubeaccel.model.checkpoint import ReservationCheckpoint
from cubeaccel.model.pinned_memory import (
    PREALLOC_POOL_MIB,
    QEMU_LOCKED_OVERHEAD_MIB,
    QEMU_LOCKED_PER_VCPU_MIB,
    TCG_CACHE_MIB,
    THREAD_CONTEXT_MIB,
)
from cubeaccel.model.reservation_params import ReservationParams
from cubeaccel.model.reservation_states import ReservationPhase as P
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from tests.support.cubelet_harness import Node

GIB = 1024
LOCKABLE = 100 * GIB


HOST = VmmHost(tcg=False, cpus=1, vfio=True)  # a KVM host: no TCG cache, no preallocation pool


def _node(tmp_path: Path, host: VmmHost = HOST) -> Node:
    cfg = CubeletConfig(reservation_ttl_s=60, release_timeout_s=10, pinnable_memory_mib=LOCKABLE, vmm_host=host)
    return Node.create(tmp_path, "h100x8", cfg)


def _reserve(node: Node, sid: str, gib: int, **kw: object) -> CubeError | None:
    try:
        node.cubelet.reserve(sid, ReservationRequest(memory_mib=gib * GIB, **kw))  # type: ignore[arg-type]
    except CubeError as e:
        return e
    return None


@pytest.mark.parametrize(("gib", "accepted"), [(64, 1), (40, 2)])
def test_three_reservations_against_100_gib_the_one_that_overdraws_is_refused(
    tmp_path: Path, gib: int, accepted: int
) -> None:
    """3 x 64 GiB: the second already overdraws 100 GiB (and the third); 3 x 40 GiB: the third does."""
    node = _node(tmp_path)
    results = [_reserve(node, f"sb-{i}", gib) for i in range(3)]
    assert [r is None for r in results] == [True] * accepted + [False] * (3 - accepted)
    refused = results[-1]
    assert refused is not None
    assert (refused.code, refused.layer, refused.status) == ("reserve.pinned_memory_exhausted", "pinned_memory", 409)
    need = gib * GIB + QEMU_LOCKED_OVERHEAD_MIB
    d = refused.details
    assert (d["requested_mib"], d["lockable_mib"], d["locked_mib"]) == (need, LOCKABLE, accepted * need)
    assert d["free_mib"] == LOCKABLE - accepted * need < need
    # Devices untouched: only the accepted sandboxes hold devices, and nothing else was written for the others.
    states = [dev.state for dev in node.devices()]
    assert states.count(DeviceState.RESERVED) == accepted and states.count(DeviceState.ALLOCATABLE) == 8 - accepted
    assert [r.sandbox_id for r in node.cubelet.store.reservations()] == [f"sb-{i}" for i in range(accepted)]
    assert not [e for e in node.cubelet.store.events(0, 10000) if e.sandbox_id == "sb-2"]
    hb = heartbeat_body(node.cubelet, "http://127.0.0.1:1")
    assert hb["pinnable_memory_mib"] == hb["pinned_memory"]["free_mib"] == LOCKABLE - accepted * need
    assert hb["pinned_memory"]["lockable_mib"] == LOCKABLE and hb["pinned_memory"]["locked_mib"] == accepted * need


def test_memory_comes_back_only_when_the_vmm_is_gone(tmp_path: Path) -> None:
    node = _node(tmp_path)
    assert _reserve(node, "a", 60) is None
    node.cubelet.start("a")
    assert _reserve(node, "b", 60) is not None
    node.cubelet.release("a")  # a cooperative VMM exits: the reservation closes, its memory is free again
    assert node.cubelet.store.reservation("a") is None
    assert _reserve(node, "b", 60) is None
    node.shim.immortal_vmm.add("b")  # this one survives SIGKILL: its memory stays locked, devices or not
    node.cubelet.start("b")
    node.cubelet.release("b")
    for _ in range(3):
        node.clock.advance(11)
        node.cubelet.try_release("b")
    assert node.cubelet.store.reservation("b") is not None
    err = _reserve(node, "c", 60)
    assert err is not None and err.code == "reserve.pinned_memory_exhausted" and "b" in err.details["sandboxes"]


def test_an_unpinned_guest_on_a_vfio_node_is_still_charged_its_ram_and_extra_vcpus_their_threads(
    tmp_path: Path,
) -> None:
    node = _node(tmp_path)
    assert _reserve(node, "loose", 50, pin_memory=False) is None  # no mem-lock, but type1 pins guest RAM
    assert _reserve(node, "wide", 10, vcpus=4) is None
    by = ledger(node.cubelet.store.reservations(), LOCKABLE, HOST).by_sandbox
    assert by == {"loose": 50 * GIB, "wide": 10 * GIB + QEMU_LOCKED_OVERHEAD_MIB + 3 * QEMU_LOCKED_PER_VCPU_MIB}
    err = _reserve(node, "third", 39)  # 39 GiB + overhead no longer fits beside them
    assert err is not None and err.code == "reserve.pinned_memory_exhausted"


def test_a_large_guest_on_a_tcg_host_is_charged_the_translation_cache_and_the_preallocation_pool(
    tmp_path: Path,
) -> None:
    node = _node(tmp_path, VmmHost(tcg=True, cpus=4, vfio=False, numa=True))
    assert _reserve(node, "big", 16) is None
    (charged,) = ledger(node.cubelet.store.reservations(), LOCKABLE, node.cubelet.vmm_host).by_sandbox.values()
    pool = PREALLOC_POOL_MIB + THREAD_CONTEXT_MIB
    assert charged == 16 * GIB + QEMU_LOCKED_OVERHEAD_MIB + TCG_CACHE_MIB + pool
    # What CubeMaster is told a VMM costs here includes the translation cache.
    assert (
        heartbeat_body(node.cubelet, "http://127.0.0.1:1")["pinned_memory"]["vmm_overhead_mib"]
        == QEMU_LOCKED_OVERHEAD_MIB + TCG_CACHE_MIB
    )


def test_without_a_configured_size_lockable_is_memavailable_plus_what_started_vmms_already_locked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("cubeaccel.cubelet.memory_ledger.available_mib", lambda: 10_000)
    params = ReservationParams(memory_mib=1000, vcpus=1, pin_memory=True)
    started = Reservation("s", params, [], P.RUNNING, 0.0, None, ReservationCheckpoint(shim_started=True))
    waiting = Reservation("w", params, [], P.RESERVED, 0.0, None)
    led = ledger([started, waiting], None, HOST)
    one = 1000 + QEMU_LOCKED_OVERHEAD_MIB
    assert (led.source, led.lockable_mib, led.locked_mib, led.free_mib) == (
        "meminfo",
        10_000 + one,
        2 * one,
        10_000 - one,
    )
