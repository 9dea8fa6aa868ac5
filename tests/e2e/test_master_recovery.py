"""CubeMaster recovering from its own crashes, against one real Cubelet process (simulated devices).

The master here is in-process (its store on a temp SQLite file) so a test can stop it at the exact
point a replica would die: after `claim()`, before the Cubelet's reply. The Cubelet is a real
`cubeaccel cubelet serve --listen` process; the heartbeat is sent by hand from its real capacity.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.cubelet.shim_driver import SIMULATED_HOTPLUG, simulated_guest_images
from cubeaccel.master import schema as S
from cubeaccel.master.maintenance import Maintenance, reconcile_node
from cubeaccel.master.service import CubeMaster, sandbox_record
from cubeaccel.master.store import MasterStore
from cubeaccel.model.sandbox_states import SandboxActor, SandboxEvent, SandboxState
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.reports import ShimReportKind
from cubeaccel.transport.cubelet_client import CubeletClient
from cubeaccel.wire.cubelet_api import LocalCheckpoint
from cubeaccel.wire.master_api import Sandbox
from cubeaccel.wire.reports import ShimReportBody
from tests.support.cubelet_process import CubeletProcess
from tests.support.master_builders import sandbox_row
from tests.support.master_harness import free_port
from tests.support.poll import poll
from tests.support.stored_rows import stored_state

NODE = "n1"
AN_HOUR = 3600.0  # far older than any live create leaves its row untouched (2 x Cubelet request timeout)


@pytest.fixture(scope="module")
def cubelet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CubeletProcess, str]]:
    port = free_port()
    proc = CubeletProcess(
        tmp_path_factory.mktemp("recovery-cubelet"), "2xh100", "--listen", f"127.0.0.1:{port}"
    ).start()
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.fixture
def master(tmp_path: Path, cubelet: tuple[CubeletProcess, str]) -> Iterator[CubeMaster]:
    proc, url = cubelet
    m = CubeMaster(MasterStore(str(tmp_path / "m.db")))
    m.auth.current_node_token = lambda node: proc.token  # type: ignore[method-assign]  # the standalone node's
    heartbeat(m, url, proc.client)
    yield m
    for r in proc.client.request("GET", "/v1/reservations")["reservations"]:  # leave the Cubelet empty
        proc.client.release(r["sandbox_id"])
    poll(lambda: all(d.state == "allocatable" for d in proc.client.devices()))
    m.store.close()


def heartbeat(m: CubeMaster, url: str, cub: CubeletClient) -> None:
    body = {
        "node": NODE,
        "cubelet_url": url,
        "version": "test",
        "sent_at": time.time(),
        "capacity": cub.capacity().model_dump(mode="json", by_alias=True),
        "pinnable_memory_mib": 1 << 20,
        "guest_images": [i.to_json() for i in simulated_guest_images()],
        "hotplug": list(SIMULATED_HOTPLUG),
    }
    m.store.heartbeat(body, time.time(), m.config.staleness_s)
    m.cache.invalidate()


def claimed_row(m: CubeMaster, sid: str) -> str:
    """A sandbox row as a create leaves it right after `claim()`: `placing` on NODE. Returns the group key."""
    now = time.time()
    assert m.store.insert_sandbox(sandbox_row(sid, now, expires_at=None)) is None
    key = m.store.all_node_views()[0].groups[0].key
    assert m.store.admit(sid, NODE, key, 1, now, m.config.staleness_s)
    return key


def age(m: CubeMaster, sid: str, seconds: float) -> None:
    """The replica that owned the create died `seconds` ago: nobody has touched the row since."""
    with m.store.tx() as c:
        c.execute(S.sandboxes.update().where(S.sandboxes.c.id == sid).values(updated_at=time.time() - seconds))


def reserve(cub: CubeletClient, sid: str, start: bool = True) -> list[str]:
    reply = cub.reserve(sid, 1, **{"class": "gpu", "start": start})
    assert reply.reservation is not None
    return list(reply.reservation.device_ids)


def test_abandoned_placing_row_whose_reservation_runs_becomes_running(
    master: CubeMaster, cubelet: tuple[CubeletProcess, str]
) -> None:
    cub = cubelet[0].client
    claimed_row(master, "sb-run")
    devices = reserve(cub, "sb-run")  # the Cubelet did its part; the replica died before recording it
    Maintenance(master).tick()
    assert stored_state(master.store, "sb-run") == "placing"  # young: may be live
    age(master, "sb-run", AN_HOUR)
    Maintenance(master).tick()
    row = master.store.sandbox("sb-run")
    assert row is not None and (row.state, list(row.device_ids)) == ("running", devices)
    assert master.delete("sb-run").state == "deleted"
    poll(lambda: all(d.state == "allocatable" for d in cub.devices()))


def test_abandoned_placing_row_without_reservation_fails_and_stops_counting_as_a_claim(master: CubeMaster) -> None:
    key = claimed_row(master, "sb-none")
    assert master.store.admitted() == {NODE: {key: 1}}
    age(master, "sb-none", AN_HOUR)
    Maintenance(master).tick()
    row = master.store.sandbox("sb-none")
    assert row is not None and row.state == "failed"
    assert row.error is not None and row.error.code == "sandbox.placement_abandoned"
    assert master.store.admitted() == {}
    assert master.delete("sb-none").state == "deleted"


def test_abandoned_reservation_that_never_started_is_released_on_the_cubelet(
    master: CubeMaster, cubelet: tuple[CubeletProcess, str]
) -> None:
    cub = cubelet[0].client
    claimed_row(master, "sb-half")
    reserve(cub, "sb-half", start=False)
    age(master, "sb-half", AN_HOUR)
    Maintenance(master).tick()
    assert stored_state(master.store, "sb-half") == "failed"
    poll(lambda: all(d.state == "allocatable" for d in cub.devices()))


def test_delete_of_an_abandoned_placing_row_releases_it_instead_of_busy_forever(
    master: CubeMaster, cubelet: tuple[CubeletProcess, str]
) -> None:
    cub = cubelet[0].client
    claimed_row(master, "sb-del")
    reserve(cub, "sb-del")
    with pytest.raises(CubeError) as e:
        master.delete("sb-del")  # a live create may still be placing it
    assert (e.value.status, e.value.code) == (409, "sandbox.busy")
    age(master, "sb-del", AN_HOUR)
    assert master.delete("sb-del").state == "deleted"
    assert master.store.admitted() == {}
    poll(lambda: all(d.state == "allocatable" for d in cub.devices()))


class _RacingClient(CubeletClient):
    """Runs `between` right after the Cubelet answered `GET /v1/reservations`, before reconcile goes on."""

    def __init__(self, url: str, between: Callable[[], None], token: str | None) -> None:
        super().__init__(url=url, token=token)
        self.between: Callable[[], None] | None = between

    def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Any:
        reply = super().request(method, path, json=json, params=params, headers=headers, timeout=timeout)
        if (method, path) == ("GET", "/v1/reservations") and self.between is not None:
            between, self.between = self.between, None
            between()
        return reply


def test_reconcile_does_not_lose_a_create_that_completes_while_it_reads_the_cubelet(
    master: CubeMaster, cubelet: tuple[CubeletProcess, str]
) -> None:
    cub, url = cubelet
    claimed_row(master, "sb-race")

    def create_completes() -> None:  # another thread's create: the Cubelet reserves, the row turns running
        devices = reserve(cub.client, "sb-race")
        assert master.store.update_sandbox(
            "sb-race",
            "reserved",
            expect=(SandboxState.PLACING,),
            event=SandboxEvent.READY,
            by=SandboxActor.PLACEMENT,
            device_ids=devices,
            cubelet_created_at=time.time(),
        )

    token = master.auth.current_node_token(NODE)
    master._clients[(url, token)] = _RacingClient(url, create_completes, token)
    report = reconcile_node(master, NODE)
    assert report["lost"] == [] and stored_state(master.store, "sb-race") == "running"
    assert reconcile_node(master, NODE)["released_orphans"] == []
    held = {r["sandbox_id"] for r in cub.client.request("GET", "/v1/reservations")["reservations"]}
    assert "sb-race" in held


def _shim_says(cub: CubeletClient, sid: str, kind: ShimReportKind) -> None:
    """A report as the sandbox's shim posts it, with its start's nonce (the unix socket shows it)."""
    res = cub.reservation(sid).reservation
    assert res is not None and isinstance(res.facts, LocalCheckpoint)
    body = ShimReportBody(sandbox_id=sid, kind=kind, details={}, at=time.time(), start_id=res.facts.start_id)
    cub.request("POST", "/v1/shim-reports", json=body.model_dump(mode="json"))


def test_a_workload_stall_whose_push_never_arrived_is_read_from_the_node_by_reconcile(
    master: CubeMaster, cubelet: tuple[CubeletProcess, str]
) -> None:
    """This Cubelet has no `--master`: every push is lost, as after its retries ran out."""
    cub = cubelet[0].client
    claimed_row(master, "sb-stall")
    devices = reserve(cub, "sb-stall")
    assert master.store.update_sandbox(
        "sb-stall", "reserved", event=SandboxEvent.READY, by=SandboxActor.PLACEMENT, device_ids=devices
    )
    _shim_says(cub, "sb-stall", ShimReportKind.WORKLOAD_UNRESPONSIVE)
    assert reconcile_node(master, NODE)["workload_healed"] == ["sb-stall"]
    shown = sandbox_record(master.get("sb-stall"), Sandbox)
    assert shown.state == "running" and shown.workload is not None and shown.workload.state == "unresponsive"
    assert reconcile_node(master, NODE)["workload_healed"] == []  # the record already says it: nothing added

    _shim_says(cub, "sb-stall", ShimReportKind.WORKLOAD_RECOVERED)
    assert reconcile_node(master, NODE)["workload_healed"] == ["sb-stall"]
    assert sandbox_record(master.get("sb-stall"), Sandbox).workload is None
    assert reconcile_node(master, NODE)["workload_healed"] == []
