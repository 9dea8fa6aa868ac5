"""The Cubelet SIGKILLed while CubeMaster's warm claim is in flight, then restarted, converges (docs/warm.md):
the create ends running as its tenant's or refused; the warm sandbox is back in the pool (the claim never reached
the journal) or torn down through the release path (it did, and its shim never acknowledged): never handed out
twice, never a device that no open reservation holds, and CubeMaster's rows, its claim rows and the Cubelet's
journal agree. Real CubeMaster (SQLite) and Cubelet processes; simulated devices and shims (the shims live in the
simulated host's file, so they outlive the Cubelet as real ones do)."""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.host.pci.simulated import SimulatedPciHost
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.master_api import SandboxReply
from tests.e2e.test_master_warm import TEMPLATE, advertised, path_entries, warm_pool
from tests.support.cubelet_process import CubeletProcess
from tests.support.master_harness import MasterProcess, cubelet, wait_nodes_ready
from tests.support.poll import poll
from tests.support.warm import claimed_warm_ids, request_waiting_on


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[MasterProcess, CubeletProcess]]:
    m = MasterProcess(tmp_path / "master", staleness=5.0).start()
    (tmp_path / "n").mkdir()
    node = cubelet(tmp_path / "n", "4xh100", "n", m.url).start()
    try:
        wait_nodes_ready(m.client, {"n"})
        m.client.register_template(TEMPLATE, default=True)
        yield m, node
    finally:
        node.stop()
        m.stop()


def _frozen_pool(m: MasterProcess, node: CubeletProcess, size: int) -> set[str]:
    warm_pool(node, size)
    poll(lambda: [p.claimable for p in advertised(m, "n")] == [size], 90, what="the pool warm")
    warm_pool(node, 0)  # no refill: the pool is exactly these
    return set(advertised(m, "n")[0].sandboxes)


def _reservations(node: CubeletProcess) -> dict[str, dict[str, Any]]:
    return {r["sandbox_id"]: r for r in node.client.request("GET", "/v1/reservations")["reservations"]}


def _row(m: MasterProcess, sid: str) -> SandboxReply | None:
    try:
        return m.client.sandbox(sid)
    except CubeError as e:
        if e.code == "sandbox.not_found":
            return None  # a refused create leaves no record
        raise


def _settled(m: MasterProcess, node: CubeletProcess) -> bool:
    """Every device is free or held by an open reservation; nothing is releasing; CubeMaster's live rows are the
    Cubelet's claimed/started reservations and the reverse; no claim row holds what no create is placing."""
    res = _reservations(node)
    if any(r["phase"] == "releasing" for r in res.values()):
        return False
    holders = {d.sandbox_id for d in node.client.devices() if d.sandbox_id}
    assert holders <= set(res), (holders, res)  # a device held by nobody
    tenants = {sid for sid, r in res.items() if not sid.startswith("warm-")}
    live = {s.id for s in m.client.sandboxes("running")}
    warm = m.client.request("GET", "/v1/sandboxes", params={"state": "warm"})["sandboxes"]
    return live == tenants and not any(w["claimed"] for w in warm)


@pytest.mark.parametrize("at", ["before-the-cas", "after-the-cas"])
def test_a_cubelet_sigkilled_mid_claim_converges_after_its_restart(
    stack: tuple[MasterProcess, CubeletProcess], at: str
) -> None:
    m, node = stack
    warm = _frozen_pool(m, node, 2)
    assert node.proc is not None
    host = SimulatedPciHost(path=node.state_dir / "simulated-host.json")
    shims = [pid for w in warm if (pid := host.find_process(f"shim:{w}")) is not None]
    assert len(shims) == 2
    if at == "before-the-cas":
        os.kill(node.proc.pid, signal.SIGSTOP)  # the claim waits unread in the Cubelet's socket
    else:
        for pid in shims:
            host.pause(pid)  # the journal's CAS lands; the hand-off waits on the stopped shim
    outcome: list[Any] = []

    def create() -> None:
        try:
            outcome.append(m.client.create({"gpu": "H100:1", "id": "sb-k"}))
        except CubeError as e:
            outcome.append(e)

    t = threading.Thread(target=create, daemon=True)
    t.start()
    try:
        poll(lambda: [e["path"] for e in path_entries(m.client.sandbox("sb-k"))] == ["warm"], 30)
        w = path_entries(m.client.sandbox("sb-k"))[0]["warm_id"]
        assert w in warm
        if at == "before-the-cas":
            port = int(node.extra[node.extra.index("--listen") + 1].rsplit(":", 1)[1])
            poll(lambda: request_waiting_on(port), 10, what="the claim in the stopped Cubelet's socket")
        else:
            claimed = poll(lambda: _reservations(node).get("sb-k"), 10, what="the claim in the journal")
            assert claimed["facts"]["shim_id"] == w and not claimed["facts"].get("claim_acked")
        node.sigkill()
    finally:
        if node.proc is not None and node.proc.poll() is None:
            os.kill(node.proc.pid, signal.SIGCONT)
        for pid in shims:
            host.pause(pid, stopped=False)
    t.join(120)
    assert outcome, "the create never returned"
    node.start()

    # The create ended either way; which way is the journal's and CubeMaster's together to agree on.
    poll(lambda: _settled(m, node), 90, what="CubeMaster and the Cubelet agree")
    row = _row(m, "sb-k")
    res = _reservations(node)
    if isinstance(outcome[0], CubeError):
        assert row is None or row.state in ("failed", "deleted"), row
        assert "sb-k" not in res
    else:
        assert row is not None and row.state == "running" and res["sb-k"]["phase"] == "running"
    events = node.client.events(0, 10000).events
    w_claims = [e for e in events if e.kind == "warm_claimed" and e.sandbox_id == w]
    if at == "before-the-cas":  # the claim never reached the journal: W is warm, advertised and claimable again
        assert not w_claims and res[w]["phase"] == "warm"
        poll(lambda: w in advertised(m, "n")[0].sandboxes, 30, what="W advertised again")
    else:  # the journal took it and the shim never acknowledged: torn down, never handed out again
        assert len(w_claims) == 1 and w not in res
        reasons = [e.reason for e in events if e.sandbox_id == "sb-k" and e.kind == "teardown_started"]
        assert reasons == ["warm.claim_unacknowledged"], reasons
    left = {x for x in warm if x in res and res[x]["phase"] == "warm"}
    poll(lambda: [p.claimable for p in advertised(m, "n")] == [len(left)], 30, what="the rest claimable")

    # The rest are handed out once each, then creates go cold: no warm sandbox in two sandboxes.
    taken = []
    for i in range(len(left) + 1):
        got = m.client.create({"gpu": "H100:1", "id": f"sb-after-{i}"})
        assert got.state == "running", got
        taken.append(path_entries(got)[-1].get("warm_id"))
    assert sorted(x for x in taken if x) == sorted(left) and taken[-1] is None
    handed = claimed_warm_ids(node)
    assert Counter(handed).most_common(1)[0][1] == 1, handed
    assert w not in handed or (at == "before-the-cas" and w in left)
    poll(lambda: _settled(m, node), 60)
