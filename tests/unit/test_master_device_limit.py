"""Devices per sandbox: a Cubelet advertises how many devices one sandbox may hold on its node, and CubeMaster
refuses a count above it with the node's reason, before any reservation, on every scheduling path (the full scan,
the fast scan and the index)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.cubelet.heartbeat import heartbeat_body
from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.process_shim import ProcessShimDriver
from cubeaccel.master.index import NodeIndex
from cubeaccel.master.scheduler import Context, decide, explain, rejection
from cubeaccel.master.service import CreateSpec, CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from cubeaccel.master.view import NodeView, view_from_heartbeat
from cubeaccel.model.request import AcceleratorChoice, AcceleratorRequest
from cubeaccel.protocol.errors import CubeError
from cubeaccel.shim.qemu import build_argv
from cubeaccel.shim.vmm import VmConfig
from cubeaccel.wire.master_api import NodeSummary
from cubeaccel.wire.shim_spec import MAX_DEVICES
from tests.support.contract_builders import example_doc
from tests.support.cubelet_harness import Node
from tests.support.master_builders import group, h100_contract, heartbeat, view

NOW, STALE = 1001.0, 10.0
H100 = "H100-PCIe-80GB"


def gpus(count: int) -> AcceleratorChoice:
    return AcceleratorChoice("gpu", count, model="H100")


def placed(nodes: list[NodeView], count: int, indexed: bool) -> tuple[list[str], dict[str, tuple[str, str]]]:
    index = None
    if indexed:
        index = NodeIndex()
        for n in nodes:
            index.put(n)
    d = decide(nodes, [(gpus(count), h100_contract(), None)], NOW, STALE, index=index)
    reasons = {n: (r.label, r.detail) for n, r in d.outcomes[-1].reasons.items()}
    return sorted({c.node.name for c in d.candidates}), reasons


@pytest.mark.parametrize("indexed", [False, True], ids=["scan", "index"])
def test_a_count_above_a_nodes_limit_is_refused_there_even_with_enough_free_devices(indexed: bool) -> None:
    small = view("small", group(H100, 16), max_devices=4)
    large = view("large", group(H100, 16), max_devices=16)
    assert placed([small, large], 4, indexed) == (["large", "small"], {})
    where, reasons = placed([small, large], 8, indexed)
    assert where == ["large"]  # the small node has 16 free devices, but one of its VMs takes 4
    where, reasons = placed([small, large], 17, indexed)
    assert where == [] and set(reasons) == {"small", "large"}
    assert reasons["small"] == ("device_limit", "17 wanted, one sandbox on this node holds at most 4")
    assert reasons["large"][0] == "device_limit"


def test_the_limit_is_named_before_the_free_count() -> None:
    """A node with 2 free devices and a limit of 4, asked for 8: its limit is the real obstacle, not the 2."""
    n = view("n", group(H100, 8, free=2), max_devices=4)
    ctx = Context(gpus(8), h100_contract(), None, NOW, STALE)
    assert explain([n], ctx).reasons["n"].code == "device_limit"
    assert explain([n], Context(gpus(4), h100_contract(), None, NOW, STALE)).reasons["n"].code == (
        "insufficient_devices"
    )


def test_above_every_nodes_limit_is_its_own_catalogued_error_with_the_largest_limit() -> None:
    nodes = [view("a", group(H100, 16), max_devices=4), view("b", group(H100, 16), max_devices=8)]
    d = decide(nodes, [(gpus(12), h100_contract(), None)], NOW, STALE)
    err = rejection(d, 2)
    assert (err.code, err.status, err.layer) == ("schedule.too_many_devices", 409, "scheduler")
    assert err.details["max_devices_per_sandbox"] == 8
    assert "ask for at most 8" in err.message and "2 device_limit" in err.message
    assert err.details["tried"][0]["nodes"]["a"]["reason"] == "device_limit"


def test_a_refusal_with_other_reasons_too_stays_unschedulable() -> None:
    nodes = [view("a", group(H100, 16), max_devices=4), view("b", group(H100, 16, free=0), max_devices=16)]
    d = decide(nodes, [(gpus(12), h100_contract(), None)], NOW, STALE)
    err = rejection(d, 2)
    assert err.code == "schedule.unschedulable"
    assert err.details["tried"][0]["reasons"] == {"device_limit": 1, "insufficient_devices": 1}


def test_an_older_heartbeat_without_the_limit_is_not_filtered_on_it() -> None:
    old = view("old", group(H100, 16))
    assert old.max_devices is None
    assert placed([old], 16, False) == (["old"], {})
    assert old.summary(NOW, STALE, NodeSummary).max_devices_per_sandbox is None
    new = view_from_heartbeat(heartbeat("new", group(H100, 1), max_devices=16), 1000.0)
    assert new.max_devices == 16 and new.summary(NOW, STALE, NodeSummary).max_devices_per_sandbox == 16
    with pytest.raises(CubeError) as err:
        view_from_heartbeat({**heartbeat("bad", group(H100, 1)), "max_devices_per_sandbox": -1}, 1000.0)
    assert err.value.code == "node.invalid_heartbeat"


def test_a_cubelets_heartbeat_advertises_the_limit_its_reserve_enforces(node: Node) -> None:
    node.shim.max_devices = 6
    assert heartbeat_body(node.cubelet, "http://127.0.0.1:1")["max_devices_per_sandbox"] == 6
    with pytest.raises(CubeError) as err:
        node.cubelet.reserve("sb-7", ReservationRequest(count=7))
    assert err.value.code == "reserve.invalid_count" and "at most 6" in err.value.message


def test_a_real_shims_limit_is_its_machines_root_ports() -> None:
    assert ProcessShimDriver.max_devices == MAX_DEVICES == 16
    cfg = VmConfig("sb", 256, 1, False, Path("/k"), Path("/i"), "", Path("/tmp/sb"))
    ports = [a for a in build_argv(cfg, "tcg") if a.startswith("pcie-root-port,")]
    assert len(ports) == MAX_DEVICES and f"id=rp{MAX_DEVICES}," in ports[-1]


class NoCubelet:
    """Stands in for every Cubelet client: a reservation attempt is recorded, and fails the test."""

    calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            NoCubelet.calls.append(name)
            raise AssertionError(f"CubeMaster called the Cubelet ({name}) for a request no node can take")

        return call


@pytest.fixture
def master(tmp_path: Path) -> Iterator[CubeMaster]:
    m = CubeMaster(MasterStore(str(tmp_path / "m.db")), MasterConfig(staleness_s=1e9))
    yield m
    m.store.close()


def test_cubemaster_refuses_above_the_advertised_limit_before_any_reservation(master: CubeMaster) -> None:
    master.store.heartbeat(heartbeat("n4", group(H100, 16), max_devices=4), time.time(), 10)
    master.registry.register(example_doc(), default=True)
    NoCubelet.calls = []
    master.client = lambda url: NoCubelet()  # type: ignore[assignment,method-assign,return-value]
    req = AcceleratorRequest((gpus(8),))
    with pytest.raises(CubeError) as err:
        master.create(CreateSpec("sb-8", "t", None, None, req, None, 1, None))
    assert err.value.code == "schedule.too_many_devices"
    assert err.value.details["tried"][0]["nodes"]["n4"]["reason"] == "device_limit"
    assert "attempts" not in err.value.details and NoCubelet.calls == []  # no Cubelet was asked to reserve
    assert master.store.all_node_views()[0].admitted == {}  # nothing was claimed on the node either
    assert master.store.sandbox("sb-8") is None
