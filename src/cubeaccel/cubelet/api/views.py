"""Journal records as the Cubelet's API shows them, and the reservation a request body asks for: what more than
one router builds (a reservation is shown by the reservation routes and by a warm claim)."""

from __future__ import annotations

from typing import Any

from cubeaccel.cubelet.lifecycle import Cubelet, ReservationRequest
from cubeaccel.cubelet.store import Event, Reservation
from cubeaccel.model.cold_start import cold_start_phases, start_path
from cubeaccel.wire import cubelet_api as W
from cubeaccel.wire.dashboard import DashboardEvent, DashboardSandbox, NodeDashboard


def reservation_request(body: W.ReservationBody) -> ReservationRequest:
    return ReservationRequest(
        count=body.count,
        accel_class=body.accel_class,
        labels=tuple(sorted(body.labels.items())),
        template=body.template,
        memory_mib=body.memory_mib,
        vcpus=body.vcpus,
        pin_memory=body.pin_memory,
        contract=body.contract,
        lifetime_s=body.lifetime_s,
        network=body.network,
        tenant=body.tenant,
    )


def shown(res: Reservation, local: bool) -> W.Reservation:
    """A reservation as served. The start nonce (`facts.start_id`) is what makes a shim report count: it goes
    to the shim in its spec and is shown on the root-only unix socket, never over TCP."""
    facts = W.LocalCheckpoint.of(res.checkpoint) if local else W.Checkpoint.of(res.checkpoint)
    return W.Reservation(
        sandbox_id=res.sandbox_id,
        params=W.ReservationParamsShown.of(res.params),
        device_ids=res.device_ids,
        phase=res.phase,
        created_at=res.created_at,
        expires_at=res.expires_at,
        facts=facts,
        releasing_since=res.releasing_since,
    )


def event_record(e: Event) -> W.Event:
    return W.Event.model_validate(e, from_attributes=True)


def reservation_view(
    cubelet: Cubelet,
    sandbox_id: str,
    local: bool = True,
    access_token: str | None = None,
    hand_off: W.WarmHandOff | None = None,
) -> W.ReservationView:
    """A sandbox's reservation, devices, timeline and failure, from one snapshot (they agree)."""
    with cubelet.store.read() as t:
        res = t.reservation(sandbox_id)
        devs = [W.Device.of(d) for d in t.devices_of(sandbox_id)]
        timeline = [W.TimelineEntry(**row) for row in t.timeline(sandbox_id)]
        failure = _failure(res, t.last_closed(sandbox_id) if res is None else None)
    return W.ReservationView(
        sandbox_id=sandbox_id,
        reservation=None if res is None else shown(res, local),
        devices=devs,
        timeline=timeline,
        failure=failure,
        access_token=access_token,
        hand_off=hand_off,
    )


def release_view(cubelet: Cubelet, sandbox_id: str, res: Reservation | None, local: bool) -> W.Release:
    """A DELETE's reply: the devices only (no timeline read to be dropped)."""
    with cubelet.store.read() as t:
        devs = [W.Device.of(d) for d in t.devices_of(sandbox_id)]
    return W.Release(
        sandbox_id=sandbox_id,
        released=res is None,
        reservation=None if res is None else shown(res, local),
        devices=devs,
    )


def dashboard_view(cubelet: Cubelet, n_events: int) -> NodeDashboard:
    sandboxes = []
    for r in cubelet.store.reservations():
        events = cubelet.store.events(0, 10000, sandbox_id=r.sandbox_id)
        sandboxes.append(
            DashboardSandbox(
                sandbox_id=r.sandbox_id,
                phase=r.phase,
                device_ids=r.device_ids,
                created_at=r.created_at,
                phases=cold_start_phases((e.kind, e.event, e.at) for e in events),
                start=start_path((e.kind, e.event, e.details) for e in events),
            )
        )
    return NodeDashboard(
        node=cubelet.config.node_name,
        devices=[W.Device.of(d) for d in cubelet.store.devices()],
        sandboxes=sandboxes,
        events=[DashboardEvent.model_validate(e, from_attributes=True) for e in cubelet.store.latest_events(n_events)],
    )


def _failure(res: Reservation | None, closed: dict[str, Any] | None) -> W.Failure | None:
    """The live reservation's failure, or the one its `reservation_closed` event kept."""
    if res is not None:
        return None if res.checkpoint.failure is None else W.Failure.of(res.checkpoint.failure)
    failure = closed.get("facts", {}).get("failure") if closed else None
    return W.Failure.model_validate(failure) if isinstance(failure, dict) else None
