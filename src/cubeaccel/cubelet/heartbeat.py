"""Cubelet → CubeMaster: register and heartbeat the capacity summary (derived from the store each time).

The body's shape is `wire.heartbeat.Heartbeat`; it goes out through the typed CubeMaster client
(`transport/master_client.py`, `Calls.heartbeat`), signed with the node's token, like every other call to CubeMaster."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from pydantic import ValidationError

from cubeaccel import __version__
from cubeaccel.backends.base import Problem
from cubeaccel.cubelet import host_ready, memory_ledger, scrub_ready
from cubeaccel.cubelet.capacity import SUMMARY_LABELS, capacity_summary
from cubeaccel.cubelet.ports import HeartbeatSource
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.master_client import MasterClient
from cubeaccel.wire.heartbeat import Heartbeat as HeartbeatBody
from cubeaccel.wire.heartbeat import HostProblem
from cubeaccel.wire.warm import WarmPoolFact, WarmSandboxFact


def heartbeat_body(cubelet: HeartbeatSource, cubelet_url: str) -> dict[str, Any]:
    """The heartbeat as the JSON it is sent as."""
    return heartbeat_message(cubelet, cubelet_url).to_json()


def heartbeat_message(cubelet: HeartbeatSource, cubelet_url: str) -> HeartbeatBody:
    sent_at = time.time()  # before the capacity is read: the summary is at least this fresh
    facts = cubelet.shim.node_facts()  # learned from the host each beat: an image removed stops being offered
    readiness, pinned = host_state(cubelet)
    return HeartbeatBody(
        node=cubelet.config.node_name,
        cubelet_url=cubelet_url,
        version=__version__,
        capacity=capacity_summary(cubelet.store.devices(), cubelet.config.node_name, [cubelet.backend.name]),
        pinnable_memory_mib=pinned.free_mib,  # free lockable memory: what a new sandbox may lock
        pinned_memory=pinned.to_json(),
        ready=readiness.ready,
        host_problems=[HostProblem(code=p.code, message=p.message) for p in (*readiness.problems, *held(cubelet))],
        guest_images=[i.to_json() for i in facts.guest_images],
        hotplug=list(facts.hotplug),
        max_devices_per_sandbox=cubelet.max_devices_per_sandbox,
        warm_pools=warm_pool_facts(cubelet),
        warm_draining=cubelet.warm.draining,
        reserve_waits=True,
        sent_at=sent_at,
        incarnation=cubelet.incarnation,
        ended=cubelet.ended.recent(),
    )


def warm_pool_facts(cubelet: HeartbeatSource) -> list[WarmPoolFact]:
    """Each warm pool's shape (the fields its key is derived from), counts and the ids ready to claim, so
    CubeMaster can match a create and name the warm sandbox it claims (docs/warm.md)."""
    out: list[WarmPoolFact] = []
    for pool in list(cubelet.warm.pools.values()):
        try:
            _, params = cubelet.request_params(pool.request)
        except CubeError:  # a pool this node can no longer build (its network refused): not advertised
            continue
        ready: list[WarmSandboxFact] = []
        with cubelet.store.read() as t:
            for r in t.reservations():
                if r.phase is not ReservationPhase.WARM or r.checkpoint.warm_pool != pool.key:
                    continue
                devs = t.devices_of(r.sandbox_id)
                labels = {k: devs[0].labels[k] for k in SUMMARY_LABELS if devs and k in devs[0].labels}
                ready.append(WarmSandboxFact(id=r.sandbox_id, labels=labels))
        warm, starting = cubelet.warm.counts(pool.key)
        digest = "none" if params.contract is None else params.contract.digest
        out.append(
            WarmPoolFact.model_validate(
                {
                    "key": pool.key,
                    "template": pool.request.template,
                    "contract_digest": str(digest),
                    "class": params.accel_class,
                    "count": params.count,
                    "memory_mib": params.memory_mib,
                    "vcpus": params.vcpus,
                    "pin_memory": params.pin_memory,
                    "network": None if params.network is None else params.network.to_json(),
                    "size": pool.size,
                    "warm": warm,
                    "starting": starting,
                    "sandboxes": ready,
                }
            )
        )
    return out


def held(cubelet: HeartbeatSource) -> tuple[Problem, ...]:
    """What holds one kind of device back on a host that is ready (`ready` stays true: the node serves its other
    devices): a missing or mismatched scrub image (scrub_ready.py). Listed with the host's problems."""
    with cubelet.store.read() as t:
        return scrub_ready.current(t)


def host_state(cubelet: HeartbeatSource) -> tuple[host_ready.Readiness, memory_ledger.Ledger]:
    """Host readiness and the pinned-memory ledger, as the heartbeat and `GET /v1/host` show them (one read)."""
    with cubelet.store.read() as t:
        readiness = host_ready.current(t)
        led = memory_ledger.ledger(t.reservations(), cubelet.config.pinnable_memory_mib, cubelet.vmm_host)
    return readiness, led


class Heartbeat:
    """Sends a heartbeat every interval; only reachability *changes* become events (no event flood)."""

    def __init__(
        self,
        cubelet: HeartbeatSource,
        master_url: str,
        cubelet_url: str,
        interval_s: float,
        token: str | Callable[[], str | None] | None = None,
    ) -> None:
        """`token`: the node token (or where to get the current one); every heartbeat is signed with it."""
        self.cubelet = cubelet
        self.token = token
        self.master_url = master_url
        self.url = f"{master_url.rstrip('/')}/v1/nodes/{cubelet.config.node_name}"  # named in reachability events
        self.cubelet_url = cubelet_url
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._reachable: bool | None = None
        self._thread = threading.Thread(target=self._run, name="cubelet-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def beat(self, master: MasterClient) -> bool:
        """One heartbeat; reachable means CubeMaster accepted it and its ack reads as `HeartbeatAck`."""
        body = heartbeat_message(self.cubelet, self.cubelet_url)
        try:
            master.heartbeat(self.cubelet.config.node_name, body)
            ok, detail = True, ""
        except (CubeError, httpx.HTTPError, ValidationError) as e:  # refused, not reached, or an unreadable ack
            ok, detail = False, str(e)[:500]
        if ok != self._reachable:
            with self.cubelet.store.tx() as t:
                t.event(
                    EventKind.MASTER_REACHABLE if ok else EventKind.MASTER_UNREACHABLE,
                    "cubelet",
                    details={"url": self.url, "error": detail},
                )
            self._reachable = ok
        return ok

    def _run(self) -> None:
        master = MasterClient(self.master_url, timeout=5.0, node_token=self.token)
        try:
            while True:
                self.beat(master)
                if self._stop.wait(self.interval_s):
                    return
        finally:
            master.close()
