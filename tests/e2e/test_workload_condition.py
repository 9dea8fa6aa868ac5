"""A sandbox whose workload service stops answering reads so everywhere its record is shown, not `running` alone.

The shim's `workload_unresponsive` report is sent here as a shim sends it (on the Cubelet's socket, with the
start's nonce) to a real Cubelet, whose status push carries it to a real CubeMaster: the sandbox's record, the
CLI's `sandbox show`/`list` and the E2B detail show the condition with its code and since-time, its state stays
`running`, and `workload_recovered` clears it."""

from __future__ import annotations

import json
import time

from typer.testing import CliRunner

from cubeaccel.cli.root import app as cli
from cubeaccel.frontdoor import mapping
from cubeaccel.protocol.reports import ShimReportKind
from cubeaccel.wire.cubelet_api import Checkpoint, LocalCheckpoint
from cubeaccel.wire.master_api import SandboxReply
from cubeaccel.wire.reports import ShimReportBody
from tests.support.master_harness import Cluster
from tests.support.poll import poll

PROFILES = {"wl": "2xh100"}


def _facts(c: Cluster, sandbox_id: str) -> LocalCheckpoint | Checkpoint:
    res = c.cubelets["wl"].client.reservation(sandbox_id).reservation
    assert res is not None
    return res.facts


def _report(c: Cluster, sandbox_id: str, kind: ShimReportKind, details: dict[str, object]) -> None:
    """What the sandbox's shim posts: the reservation's start nonce makes it count."""
    facts = _facts(c, sandbox_id)
    assert isinstance(facts, LocalCheckpoint), "the unix socket shows the start nonce"
    start_id = facts.start_id
    body = ShimReportBody(sandbox_id=sandbox_id, kind=kind, details=details, at=time.time(), start_id=start_id)
    c.cubelets["wl"].client.request("POST", "/v1/shim-reports", json=body.model_dump(mode="json"))


def test_an_unanswering_workload_service_is_named_on_the_sandbox_until_it_recovers(c: Cluster) -> None:
    s = c.c.create({"gpu": "H100:1"})
    poll(lambda: c.c.sandbox(s.id).state == "running", 30, what="the sandbox running")
    assert c.c.sandbox(s.id).workload is None
    before = time.time()

    _report(c, s.id, ShimReportKind.WORKLOAD_UNRESPONSIVE, {"reason": "workload.unresponsive", "message": "20 s"})
    poll(lambda: c.c.sandbox(s.id).workload is not None, 20, what="CubeMaster showing the condition")
    shown = c.c.sandbox(s.id)
    assert shown.state == "running"  # a condition beside the state: the VM and its devices are still the tenant's
    assert shown.workload is not None
    assert (shown.workload.state, shown.workload.reason) == ("unresponsive", "workload.unresponsive")
    assert before <= shown.workload.since <= time.time()
    facts = _facts(c, s.id)
    assert (facts.workload_reason, facts.workload_unresponsive_since) == ("workload.unresponsive", shown.workload.since)

    env = {"CUBEACCEL_MASTER": c.master.url, "CUBEACCEL_API_KEY": c.master.admin_key, "COLUMNS": "200"}
    show = CliRunner().invoke(cli, ["sandbox", "show", s.id], env=env)
    assert show.exit_code == 0, show.output
    assert json.loads(show.output)["workload"]["reason"] == "workload.unresponsive"
    listed = CliRunner().invoke(cli, ["sandbox", "list"], env=env)
    assert "workload unresponsive: workload.unresponsive" in listed.output
    board = c.c.request("GET", "/v1/dashboard")
    row = next(x for x in board["sandboxes"] if x["id"] == s.id)
    assert (row["state"], row["workload"]["state"]) == ("running", "unresponsive")  # the dashboard's data
    e2b = mapping.detail(SandboxReply.model_validate(shown.model_dump()), "tok", None).body()
    assert e2b["state"] == "running" and e2b["workload"]["reason"] == "workload.unresponsive"

    _report(c, s.id, ShimReportKind.WORKLOAD_RECOVERED, {"message": "answering again"})
    poll(lambda: c.c.sandbox(s.id).workload is None, 20, what="the condition cleared")
    phases = [t.phase for t in c.c.sandbox(s.id).timeline]
    assert phases[-2:] == ["workload_unresponsive", "workload_recovered"]  # the history stays on the timeline
    assert _facts(c, s.id).workload_unresponsive_since is None
    assert "workload" not in mapping.detail(c.c.sandbox(s.id), "tok", None).body()
