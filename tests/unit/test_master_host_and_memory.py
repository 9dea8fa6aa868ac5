"""CubeMaster on host readiness and pinned memory: a not-ready node is filtered with its host codes, and memory
placed between heartbeats is deducted like devices, in the scheduler and under the store's row lock."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from cubeaccel.master.scheduler import decide, rejection
from cubeaccel.master.schema import SCHEMA_VERSION
from cubeaccel.master.store import MasterStore
from cubeaccel.master.view import view_from_heartbeat
from cubeaccel.model.request import AcceleratorChoice
from cubeaccel.model.sandbox_states import SandboxActor, SandboxEvent
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.master_api import NodeSummary
from tests.support.master_builders import group, h100_contract, heartbeat, sandbox_row, view

H100 = "H100-PCIe-80GB"
GIB = 1024
LEDGER = {
    "lockable_mib": 100 * GIB,
    "locked_mib": 0,
    "free_mib": 100 * GIB,
    "vmm_overhead_mib": 400,
    "vmm_overhead_per_vcpu_mib": 80,
}


def _reasons(nodes: list[Any], memory_mib: int = 1024) -> dict[str, tuple[str, str]]:
    d = decide(nodes, [(AcceleratorChoice("gpu", 1), h100_contract(memory_mib), None)], 1001.0, 10.0)
    return {n: (r.label, r.detail) for n, r in d.outcomes[-1].reasons.items()}


def test_a_node_whose_host_is_not_ready_is_filtered_with_the_host_codes() -> None:
    problems = [("host.no_iommu", "no IOMMU: /sys/kernel/iommu_groups is empty"), ("host.pvm_unsupported", "PVM")]
    n = view("pvm", group(H100, 2), host_problems=problems)  # even with devices claimed allocatable
    label, detail = _reasons([n])["pvm"]
    assert label == "host_not_ready"
    assert detail.startswith("host.no_iommu, host.pvm_unsupported: no IOMMU")
    d = decide([n], [(AcceleratorChoice("gpu", 1), h100_contract(), None)], 1001.0, 10.0)
    err = rejection(d, 1)
    assert "1 host_not_ready" in err.message and err.details["tried"][0]["nodes"]["pvm"]["reason"] == "host_not_ready"
    shown = n.summary(1001.0, 10.0, NodeSummary)
    assert shown.ready is False and shown.schedulable is False
    assert [p.code for p in shown.host_problems] == ["host.no_iommu", "host.pvm_unsupported"]


def test_an_older_heartbeat_without_readiness_counts_as_ready() -> None:
    assert view("n", group(H100, 1)).host_ready is True
    with pytest.raises(CubeError) as err:
        view_from_heartbeat({**heartbeat("n", group(H100, 1)), "ready": "yes"}, 1000.0)
    assert err.value.code == "node.invalid_heartbeat"


@pytest.mark.parametrize(("memory_gib", "fits"), [(64, 1), (40, 2)])  # 100 GiB lockable, 400 MiB VMM overhead
def test_memory_claimed_between_heartbeats_is_deducted(tmp_path: Path, memory_gib: int, fits: int) -> None:
    store = MasterStore(str(tmp_path / "m.db"))
    store.heartbeat(heartbeat("n", group(H100, 8), pinnable=100 * GIB, pinned=LEDGER), time.time(), 10)
    key = store.all_node_views()[0].groups[0].key
    placed, refused = [], {}
    for i in range(3):
        sid = f"sb-{i}"
        now = time.time()
        store.insert_sandbox(sandbox_row(sid, now))
        views = store.all_node_views()
        reasons = _reasons(views, memory_gib * GIB)
        if reasons:
            refused[sid] = reasons["n"]
            continue
        need = views[0].locked_mib(memory_gib * GIB, 1, True)
        assert need == memory_gib * GIB + 400
        assert store.admit(sid, "n", key, 1, now, 10, need)
        placed.append(sid)
    assert placed == [f"sb-{i}" for i in range(fits)]
    assert {r[0] for r in refused.values()} == {"pinned_memory"} and len(refused) == 3 - fits
    assert store.all_node_views()[0].admitted_memory_mib == fits * (memory_gib * GIB + 400)
    # The row lock re-checks memory too: a replica deciding on an old copy cannot overdraw the node.
    assert not store.admit("sb-2", "n", key, 1, time.time(), 10, memory_gib * GIB + 400)
    store.close()


def test_a_heartbeat_that_shows_the_reservation_absorbs_the_memory_claim(tmp_path: Path) -> None:
    store = MasterStore(str(tmp_path / "m.db"))
    store.heartbeat(heartbeat("n", group(H100, 8), pinnable=100 * GIB, pinned=LEDGER), time.time(), 10)
    key = store.all_node_views()[0].groups[0].key
    now = time.time()
    store.insert_sandbox(sandbox_row("a", now))
    assert store.admit("a", "n", key, 1, now, 10, 40 * GIB + 400)
    store.update_sandbox(
        "a", "reserved", event=SandboxEvent.READY, by=SandboxActor.PLACEMENT, cubelet_created_at=1500.0
    )
    assert store.all_node_views()[0].free_pinnable_mib() == 60 * GIB - 400
    hb = heartbeat("n", group(H100, 8, free=7), pinnable=60 * GIB - 400, pinned=LEDGER)
    hb["sent_at"] = 1501.0
    store.heartbeat(hb, time.time(), 10)
    v = store.all_node_views()[0]
    assert (v.admitted_memory_mib, v.free_pinnable_mib()) == (0, 60 * GIB - 400)  # counted once, not twice
    store.close()


def test_migration_to_v2_adds_the_pinned_column_to_an_existing_database(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    MasterStore(str(db)).close()
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.begin() as c:
        c.execute(sa.text("ALTER TABLE sandboxes DROP COLUMN pinned_mib"))
        c.execute(sa.text("UPDATE meta SET value='1' WHERE key='schema_version'"))
    engine.dispose()
    store = MasterStore(str(db))
    assert store.schema_version == SCHEMA_VERSION
    with store.tx() as c:
        assert "pinned_mib" in {col["name"] for col in sa.inspect(c).get_columns("sandboxes")}
    store.close()
