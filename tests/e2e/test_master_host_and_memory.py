"""Real CubeMaster + real Cubelets: a `--backend vfio` Cubelet on this PVM host (no IOMMU) advertises nothing and
CubeMaster refuses with the host's reasons; 64 GiB sandboxes against 100 GiB of lockable memory are refused at
`pinned_memory`, over the Cubelet API and through CubeMaster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cubeaccel.cubelet.memory_ledger import VmmHost, locked
from cubeaccel.host.pci.readiness import check_host
from cubeaccel.model.reservation_params import ReservationParams
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.master_api import NodeSummary
from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import MasterProcess, example, free_port
from tests.support.poll import poll

GIB = 1024


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    m = MasterProcess(tmp_path / "master").start()
    yield m
    m.stop()


def _node(m: MasterProcess, name: str) -> NodeSummary | None:
    return next((n for n in m.client.nodes() if n.node == name), None)


def _refused(m: MasterProcess, body: dict[str, object]) -> CubeError:
    with pytest.raises(CubeError) as e:
        m.client.create(body)
    return e.value


def test_vfio_cubelet_on_this_host_advertises_nothing_and_cubemaster_refuses_with_the_host_reason(
    tmp_path: Path, master: MasterProcess
) -> None:
    """The real /sys, /dev and /proc of this machine (read-only: nothing is bound on a host that is not ready)."""
    real = check_host()
    if real.ready:
        pytest.skip("this host can pass devices through; the scenario is a host that cannot")
    expected = [c.code for c in real.failures]
    state = tmp_path / "cubelet"
    state.mkdir()
    p = CubeletProcess(
        state,
        "-",
        "--backend",
        "vfio",
        "--master",
        master.url,
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--node",
        "this-host",
        "--node-token-file",
        str(master.enrol("this-host", state)),
    ).start()
    try:
        host = p.client.host()
        assert host.ready is False and [x.code for x in host.problems] == expected
        assert not [d for d in p.client.devices() if d.state == "allocatable"]
        with pytest.raises(CubeError) as err:
            p.client.reserve("sb-direct", 1)
        assert (err.value.code, err.value.layer) == ("host.not_ready", "host_hardware")
        node = poll(lambda: _node(master, "this-host"))
        assert node.ready is False and node.schedulable is False and node.allocatable == 0
        assert [x.code for x in node.host_problems] == expected
        master.client.register_template(example("cuda12-h100", spec__memory__size_mib=1024), default=True)
        e = _refused(master, {"gpu": "H100:1"})
        assert e.code == "schedule.unschedulable"
        why = e.details["tried"][0]["nodes"]["this-host"]
        assert why["reason"] == "host_not_ready"
        assert all(code in why["detail"] for code in expected)
        events = [x for x in p.client.events(0, 10000).events if x.kind in ("host_ready", "host_not_ready")]
        assert [x.kind for x in events] == ["host_not_ready"]  # one event at startup, none per tick
    finally:
        p.stop()


def test_64_gib_sandboxes_against_100_gib_lockable_are_refused_at_pinned_memory_over_the_cubelet_api(
    tmp_path: Path,
) -> None:
    """3 x 64 GiB, each with the VMM's overhead: only the first fits in 100 GiB (no CubeMaster: nothing else
    releases what this test reserves)."""
    p = CubeletProcess(tmp_path, "h100x8", "--pinnable-memory-mib", str(100 * GIB)).start()
    try:
        outcomes: list[str] = []
        for i in range(3):
            try:
                p.client.reserve(f"api-{i}", 1, memory_mib=64 * GIB)
                outcomes.append("reserved")
            except CubeError as e:
                assert (e.layer, e.status) == ("pinned_memory", 409), e
                outcomes.append(e.code)
        assert outcomes == ["reserved", "reserve.pinned_memory_exhausted", "reserve.pinned_memory_exhausted"]
        assert sum(d.state == "reserved" for d in p.client.devices()) == 1  # the refused ones touched nothing
        ledger = p.client.host().pinned_memory
        # The VMM's own locked memory on this host: its accelerator (TCG cache) and CPUs (preallocation pool).
        charged = locked(
            ReservationParams(memory_mib=64 * GIB, vcpus=1, pin_memory=True), VmmHost.here(vfio=True)
        ).node_mib
        assert charged >= 64 * GIB + 400
        assert ledger.lockable_mib == 100 * GIB and ledger.sandboxes == {"api-0": charged}
        p.client.release("api-0")
        assert p.client.host().pinned_memory.locked_mib == 0
        p.client.reserve("api-1", 1, memory_mib=64 * GIB)  # freed memory is lockable again
    finally:
        p.stop()


def test_sandboxes_against_100_gib_lockable_are_refused_at_pinned_memory_through_cubemaster(
    tmp_path: Path, master: MasterProcess
) -> None:
    """3 x 40 GiB: the third is refused by the scheduler (claims deducted between heartbeats); 64 GiB: the second."""
    state = tmp_path / "cubelet"
    state.mkdir()
    p = CubeletProcess(
        state,
        "h100x8",
        "--pinnable-memory-mib",
        str(100 * GIB),
        "--master",
        master.url,
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--node",
        "n100",
        "--node-token-file",
        str(master.enrol("n100", state)),
    ).start()
    try:
        poll(lambda: _node(master, "n100"))
        for gib in (40, 64):
            master.client.register_template(
                example("cuda12-h100", metadata__name=f"h100-{gib}g", spec__memory__size_mib=gib * GIB)
            )
        created = [master.client.create({"gpu": "H100:1", "template": "h100-40g"}) for _ in range(2)]
        assert [s.node for s in created] == ["n100", "n100"]
        e = _refused(master, {"gpu": "H100:1", "template": "h100-40g"})
        assert e.code == "schedule.unschedulable", (e.code, e.message, e.details)
        assert e.details["tried"][0]["reasons"] == {"pinned_memory": 1}
        assert "pinned_memory" in e.details["tried"][0]["nodes"]["n100"]["detail"]
        node = poll(lambda: n if (n := _node(master, "n100")) and (n.pinned_memory.locked_mib or 0) > 0 else None)
        assert node.pinned_memory.lockable_mib == 100 * GIB
        for s in created:  # whatever state each has reached: "running" only would leave a starting one holding 40 GiB
            master.client.delete(s.id)
        poll(
            lambda: (
                (n := _node(master, "n100")) and n.pinned_memory.locked_mib == 0 and n.pinned_memory.claimed_mib == 0
            )
        )
        assert master.client.create({"gpu": "H100:1", "template": "h100-64g"}).node == "n100"
        e = _refused(master, {"gpu": "H100:1", "template": "h100-64g"})
        assert e.code == "schedule.unschedulable", (e.code, e.message, e.details)
        assert e.details["tried"][0]["reasons"] == {"pinned_memory": 1}
    finally:
        p.stop()
