"""create → kill → create → kill → create on a one-GPU node whose killed sandbox's device is still being scrubbed,
with the node's warm pool refilling: each create waits for the device (in arrival order, within its bound) and
gets it; it is never answered 409 because the node's capacity was in motion, and the refill never takes the device
the waiting create is owed (docs/master.md, master/capacity_wait.py, cubelet/capacity_wait.py).

A real CubeMaster (SQLite store) and a real Cubelet (journal, lifecycle, warm pools) on a simulated host, joined
in process: the Cubelet's HTTP routes are stood in for by the calls they make, and the test sends the node's
heartbeats itself, so CubeMaster hears that the device is back only when the test says."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.cubelet.api.views import release_view, reservation_request, reservation_view
from cubeaccel.cubelet.heartbeat import heartbeat_body
from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.master.records import SandboxRow
from cubeaccel.master.service import CreateSpec, CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from cubeaccel.model.request import AcceleratorChoice, AcceleratorRequest
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.cubelet_api import Release, ReservationBody, ReservationView, WarmHandOff
from cubeaccel.wire.warm import WarmClaimBody
from tests.host.test_cubelet_scrub import PASSED, GatedRunner
from tests.support.contract_builders import example_doc
from tests.support.cubelet_harness import Node
from tests.support.poll import poll

URL = "http://127.0.0.1:1"


class InProcess:
    """The Cubelet's reservation routes as `cubelet/server.py` runs them, without the HTTP in between."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def reserve(self, body: ReservationBody) -> ReservationView:
        c = self.node.cubelet
        c.reserve(body.sandbox_id, reservation_request(body), capacity_wait_s=body.capacity_wait_s or 0.0)
        if body.start:
            c.start(body.sandbox_id, body.workload_token.get_secret_value() if body.workload_token else None)
        return reservation_view(c, body.sandbox_id, True, access_token=c.take_token(body.sandbox_id))

    def claim_warm(self, body: WarmClaimBody) -> ReservationView:
        given = body.workload_token.get_secret_value() if body.workload_token else None
        _, token, ack = self.node.cubelet.warm.claim(body.sandbox_id, reservation_request(body), given, body.warm_id)
        hand_off = WarmHandOff(reseed_ms=ack.reseed_ms, rebind_ms=ack.rebind_ms, reseeded=ack.reseeded)
        return reservation_view(self.node.cubelet, body.sandbox_id, True, access_token=token, hand_off=hand_off)

    def release(self, sandbox_id: str) -> Release:
        return release_view(self.node.cubelet, sandbox_id, self.node.cubelet.release(sandbox_id), True)


def beat(m: CubeMaster, node: Node) -> None:
    body = heartbeat_body(node.cubelet, URL)
    m.store.heartbeat(body, body["sent_at"], 1e9)
    m.cache.invalidate()


@pytest.fixture
def one_gpu(tmp_path: Path) -> Iterator[tuple[CubeMaster, Node, GatedRunner]]:
    (tmp_path / "node").mkdir()
    node = Node.create(tmp_path / "node", "h100")
    gate = GatedRunner(PASSED)
    gate.gate.set()
    node.scrub.runner = gate
    m = CubeMaster(MasterStore(str(tmp_path / "m.db")), MasterConfig(staleness_s=1e9))
    m.registry.register(example_doc(), default=True)
    cubelet = InProcess(node)
    m.client = lambda url: cubelet  # type: ignore[assignment,method-assign,return-value]
    node.cubelet.warm.set_pool(ReservationRequest(count=1, template="warm-shape"), 1)
    yield m, node, gate
    node.cubelet.warm.stop()
    gate.gate.set()
    m.store.close()


def spec(sid: str) -> CreateSpec:
    req = AcceleratorRequest((AcceleratorChoice("gpu", 1, model="H100"),))
    return CreateSpec(sid, "t", None, None, req, None, 1, None, capacity_wait_s=30)


class Create(threading.Thread):
    def __init__(self, m: CubeMaster, sid: str) -> None:
        super().__init__(daemon=True)
        self.m, self.sid = m, sid
        self.row: SandboxRow | None = None
        self.error: CubeError | None = None

    def run(self) -> None:
        try:
            self.row, _ = self.m.create(spec(self.sid))
        except CubeError as e:
            self.error = e


def test_create_right_after_kill_waits_for_the_scrubbed_device_and_the_refill_does_not_take_it(
    one_gpu: tuple[CubeMaster, Node, GatedRunner],
) -> None:
    m, node, gate = one_gpu
    (dev,) = node.states()
    beat(m, node)
    row, _ = m.create(spec("sb-0"))
    assert row.state == "running" and list(row.device_ids) == [dev]
    node.cubelet.warm.start()  # the refill runs from here on: it has no device, so it waits for one
    for killed, sid in (("sb-0", "sb-1"), ("sb-1", "sb-2")):
        _kill_then_create(m, node, gate, killed, sid)


def _kill_then_create(m: CubeMaster, node: Node, gate: GatedRunner, killed: str, sid: str) -> None:
    (dev,) = node.states()
    gate.gate.clear()  # the scrub of the killed sandbox's device takes until the test opens the gate
    assert m.delete(killed).state in ("deleting", "deleted")
    poll(lambda: node.device(dev).state is DeviceState.RELEASED, 10, what="the device being scrubbed")
    beat(m, node)  # CubeMaster hears that the device is coming back
    create = Create(m, sid)
    create.start()
    poll(lambda: create.error or len(m.waiters) == 1, 10, what="the create waiting for the device")
    # it is placed on the node whose device is coming back, and its reserve waits there: owed the device
    poll(lambda: create.error or m.get(sid).state == "placing", 10, what="the create placed on the node")
    poll(lambda: create.error or len(node.cubelet.capacity_waits) == 1, 10, what="the node holding it the device")
    assert create.error is None, create.error
    gate.gate.set()  # the scrub passes: the device is back; the refill is woken by it too
    poll(lambda: node.device(dev).state is not DeviceState.ALLOCATABLE, 10, what="someone took the device")
    stop = threading.Event()

    def beats() -> None:  # from now on CubeMaster hears from the node as it would
        while not stop.wait(0.1):
            beat(m, node)

    beating = threading.Thread(target=beats, daemon=True)
    beating.start()
    try:
        create.join(30)
    finally:
        stop.set()
        beating.join(5)
    assert create.error is None, create.error
    assert create.row is not None and create.row.state == "running" and list(create.row.device_ids) == [dev]
    assert node.device(dev).sandbox_id == sid  # the create's, not a warm start's
    assert node.cubelet.warm.views()[0].failures == 0  # the refill waited; it never failed for want of a device


class Beating:
    """The node's heartbeats to CubeMaster every 0.1 s while in use, as a running Cubelet sends them."""

    def __init__(self, m: CubeMaster, node: Node) -> None:
        self.m, self.node = m, node
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            beat(self.m, self.node)

    def __enter__(self) -> Beating:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(5)


def test_a_create_whose_returning_device_the_refill_took_first_gets_the_warm_sandbox_it_became(
    one_gpu: tuple[CubeMaster, Node, GatedRunner],
) -> None:
    """The device came back and the warm refill (of the create's own shape) took it a moment before the create's
    reserve reached the node: the node refuses, and the create waits for that warm start and claims it."""
    m, node, gate = one_gpu
    (dev,) = node.states()
    warm = node.cubelet.warm
    beat(m, node)
    m.create(spec("sb-0"))
    gate.gate.clear()
    m.delete("sb-0")
    poll(lambda: node.device(dev).state is DeviceState.RELEASED, 10, what="the device being scrubbed")
    beat(m, node)  # CubeMaster's last word from the node: the device is coming back
    c = m.registry.default_for("gpu")
    shape = ReservationRequest(
        count=1,
        accel_class="gpu",
        template=c.template_name,
        memory_mib=c.memory_mib,
        vcpus=1,
        pin_memory=c.pin_memory,
        contract=c,
    )
    warm.set_pool(ReservationRequest(count=1, template="warm-shape"), 0)  # only a pool of the create's own shape
    warm.set_pool(shape, 1)
    warm.start()
    gate.gate.set()  # back: the refill, woken by it, takes it before any create asks
    poll(lambda: (node.device(dev).sandbox_id or "").startswith("warm-"), 10, what="the refill took the device")
    create = Create(m, "sb-1")
    create.start()
    poll(lambda: create.error or len(m.waiters) == 1, 10, what="the create waiting")
    with Beating(m, node):
        create.join(30)
    assert create.error is None, create.error
    assert create.row is not None and create.row.state == "running" and list(create.row.device_ids) == [dev]
    assert [t.model_dump()["path"] for t in create.row.timeline if t.phase == "path"][-1] == "warm"
