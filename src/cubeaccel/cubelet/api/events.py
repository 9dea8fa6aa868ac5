"""The node's event journal, read by cursor: every device transition, reservation step and repair, in order."""

from __future__ import annotations

from fastapi import APIRouter

from cubeaccel.cubelet.api.deps import CubeletDep
from cubeaccel.cubelet.api.views import event_record
from cubeaccel.cubelet.lifecycle import validate_sandbox_id
from cubeaccel.protocol.errors import invalid
from cubeaccel.wire import cubelet_api as W

router = APIRouter()


@router.get("/v1/events", response_model=W.EventPage)
def events(
    cubelet: CubeletDep, since: int = 0, limit: int = 1000, device_id: str | None = None, sandbox_id: str | None = None
) -> W.EventPage:
    if not 0 <= since < 2**62 or not 1 <= limit <= 10000:
        raise invalid("api.invalid_cursor", "since must be ≥ 0 and limit 1..10000")
    if sandbox_id is not None:
        validate_sandbox_id(sandbox_id)
    evs = cubelet.store.events(since, limit, device_id, sandbox_id=sandbox_id)
    return W.EventPage(events=[event_record(e) for e in evs], next=evs[-1].seq if evs else since)
