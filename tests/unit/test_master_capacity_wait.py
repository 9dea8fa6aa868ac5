"""Issue 29: a create waits for capacity that is coming back — devices being released or scrubbed, or held by a
sandbox being deleted — within a bound, in arrival order; capacity that cannot come back is refused at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.master.records import SandboxRow
from cubeaccel.master.service import CreateSpec, CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from cubeaccel.master.view import group_key
from cubeaccel.model.checkpoint import ReservationCheckpoint
from cubeaccel.model.request import AcceleratorChoice, AcceleratorRequest
from cubeaccel.model.reservation_params import ReservationParams
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.cubelet_api import Checkpoint, Reservation, ReservationBody, ReservationParamsShown, ReservationView
from tests.support.contract_builders import example_doc
from tests.support.master_builders import group, heartbeat, sandbox_row
from tests.support.poll import poll

H100 = "H100-PCIe-80GB"


class Cubelet:
    """Reserves whatever it is asked for and says the guest validated (no Cubelet round trip in this test)."""

    def reserve(self, body: ReservationBody) -> ReservationView:
        sid = body.sandbox_id
        return ReservationView(
            sandbox_id=sid,
            reservation=Reservation(
                sandbox_id=sid,
                params=ReservationParamsShown.of(ReservationParams()),
                device_ids=[f"dev-{sid}"],
                phase=ReservationPhase.RUNNING,
                created_at=time.time(),
                expires_at=None,
                facts=Checkpoint.of(ReservationCheckpoint()),
                releasing_since=None,
            ),
            devices=[],
            timeline=[],
            failure=None,
        )


@pytest.fixture
def master(tmp_path: Path) -> Iterator[CubeMaster]:
    m = CubeMaster(MasterStore(str(tmp_path / "m.db")), MasterConfig(staleness_s=1e9))
    m.registry.register(example_doc(), default=True)
    m.client = lambda url: Cubelet()  # type: ignore[assignment,method-assign,return-value]
    yield m
    m.store.close()


def beat(m: CubeMaster, **by_state: int) -> None:
    g = group(H100, sum(by_state.values()), free=by_state.get("allocatable", 0))
    g["by_state"] = by_state
    m.store.heartbeat(heartbeat("n1", g), time.time(), 10)
    m.cache.invalidate()


def spec(sid: str, wait_s: float | None = None) -> CreateSpec:
    req = AcceleratorRequest((AcceleratorChoice("gpu", 1, model="H100"),))
    return CreateSpec(sid, "t", None, None, req, None, 1, None, capacity_wait_s=wait_s)


class Create(threading.Thread):
    def __init__(self, m: CubeMaster, s: CreateSpec) -> None:
        super().__init__(daemon=True)
        self.m, self.s = m, s
        self.row: SandboxRow | None = None
        self.error: CubeError | None = None

    def run(self) -> None:
        try:
            self.row, _ = self.m.create(self.s)
        except CubeError as e:
            self.error = e


def test_a_create_waits_for_a_device_being_scrubbed_and_creates_take_it_in_arrival_order(master: CubeMaster) -> None:
    beat(master, releasing=1)
    first = Create(master, spec("sb-first", 30))
    first.start()
    poll(lambda: len(master.waiters) == 1, 10)
    second = Create(master, spec("sb-second", 30))
    second.start()
    poll(lambda: len(master.waiters) == 2, 10)
    assert first.row is None and second.row is None and first.error is None  # both still waiting
    beat(master, allocatable=1)  # scrubbed and revalidated: one device back
    first.join(20)
    second.join(20)
    assert first.row is not None and first.row.state == "running", first.error
    # the device went to the earlier create; nothing else is coming back, so the later one is refused at once
    assert second.error is not None and second.error.code == "schedule.unschedulable", second.error
    assert len(master.waiters) == 0


def test_when_the_bound_passes_the_error_says_the_devices_are_coming_back(master: CubeMaster) -> None:
    beat(master, released=1)
    with pytest.raises(CubeError) as e:
        master.create(spec("sb-late", 0.3))
    assert (e.value.code, e.value.status, e.value.details["returning_devices"]) == (
        "schedule.capacity_returning",
        503,
        1,
    )
    assert "being released or scrubbed" in e.value.message and "0.3s" in e.value.message
    assert master.store.sandbox("sb-late") is None


def test_a_device_of_a_sandbox_being_deleted_counts_before_any_summary_shows_it(master: CubeMaster) -> None:
    beat(master, attached=1)
    key = group_key("gpu", group(H100, 1)["labels"])
    now = time.time()
    master.store.insert_sandbox(
        sandbox_row("sb-old", now, state="deleting", node="n1", group_key=key, cubelet_created_at=1.0)
    )
    with pytest.raises(CubeError) as e:
        master.create(spec("sb-new", 0.3))
    assert e.value.code == "schedule.capacity_returning", e.value


@pytest.mark.parametrize(("deleted_after_the_beat", "code"), [(True, "capacity_returning"), (False, "unschedulable")])
def test_a_device_of_a_sandbox_deleted_since_the_nodes_last_heartbeat_counts_as_coming_back(
    master: CubeMaster, deleted_after_the_beat: bool, code: str
) -> None:
    """CI found this: a create right after a kill saw the last summary (device still attached) and no deleting
    row (the delete had finished), so it was refused at once although the device was on its way back."""
    beat(master, attached=1)
    heard = time.time()  # the beat was received at or just before this
    key = group_key("gpu", group(H100, 1)["labels"])
    at = heard + 5 if deleted_after_the_beat else heard - 5
    master.store.insert_sandbox(
        sandbox_row("sb-gone", at, state="deleted", node="n1", group_key=key, cubelet_created_at=1.0)
    )
    with pytest.raises(CubeError) as e:
        master.create(spec("sb-new", 0.3))
    assert e.value.code == f"schedule.{code}", e.value


@pytest.mark.parametrize("state", ["quarantined", "unhealthy", "disabled", "attached"])
def test_capacity_that_cannot_come_back_is_refused_at_once(master: CubeMaster, state: str) -> None:
    beat(master, **{state: 1})
    with pytest.raises(CubeError) as e:
        master.create(spec("sb-never", 30))
    assert e.value.code == "schedule.unschedulable"
    assert e.value.details["tried"][0]["nodes"]["n1"]["reason"] == "insufficient_devices"


class RefusesOnce(Cubelet):
    """A node whose summary said a device was free, but whose device went elsewhere meanwhile (capacity in motion:
    a release, a scrub, the warm refill): it refuses the first reserve for capacity, as a Cubelet does."""

    def __init__(self) -> None:
        self.bodies: list[ReservationBody] = []

    def reserve(self, body: ReservationBody) -> ReservationView:
        self.bodies.append(body)
        if len(self.bodies) == 1:
            raise CubeError("reserve.insufficient_devices", "1 device(s) requested, not enough", "cubelet", {}, 409)
        return super().reserve(body)


def test_a_node_refusing_for_capacity_its_summary_showed_free_is_waited_for_not_answered_409(
    master: CubeMaster,
) -> None:
    node = RefusesOnce()
    master.client = lambda url: node  # type: ignore[assignment,method-assign,return-value]
    beat(master, allocatable=1)
    create = Create(master, spec("sb-again", 30))
    create.start()
    poll(lambda: create.error or (len(node.bodies) == 1 and len(master.waiters) == 1), 10, what="waiting")
    assert create.row is None and create.error is None, create.error  # not answered: waiting for the node's word
    beat(master, allocatable=1)  # a heartbeat sent after the refusal: the node is asked again
    create.join(20)
    assert create.error is None, create.error
    assert create.row is not None and create.row.state == "running" and len(node.bodies) == 2
    assert [t.phase for t in create.row.timeline].count("reserve_refused") == 1


def test_a_node_refusing_for_capacity_with_nothing_coming_back_is_refused_once_it_says_so(
    master: CubeMaster,
) -> None:
    node = RefusesOnce()
    master.client = lambda url: node  # type: ignore[assignment,method-assign,return-value]
    beat(master, allocatable=1)
    create = Create(master, spec("sb-taken", 30))
    create.start()
    poll(lambda: len(master.waiters) == 1, 10)
    beat(master, attached=1)  # its next heartbeat: the device is held by a running sandbox
    create.join(20)
    assert create.error is not None and create.error.code == "schedule.unschedulable", create.error
    assert create.error.details["attempts"][0]["code"] == "reserve.insufficient_devices"
