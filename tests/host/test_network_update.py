"""A running sandbox's egress policy changed in place: the namespace's ruleset replaced whole (real namespaces and
nftables, a namespace standing in for the guest; no VM), and the Cubelet's journal-then-load of a change."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.cubelet import network_update
from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.reconcile import reconcile
from cubeaccel.host.net import netpolicy
from cubeaccel.model.reservation_params import NetworkRequest
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.model.sandbox_policy import NetworkPolicy
from cubeaccel.protocol.errors import CubeError
from tests.host.test_netpolicy import (  # noqa: F401 (fixtures)
    _tool_contract,
    in_ns,
    needs_net,
    probe,
    routed,
    sh,
    stand_in_guest,
    uplink,
)
from tests.support.cubelet_harness import Node
from tests.support.poll import poll

ECHO = """
import socket, sys, threading
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", port)); s.listen()
    while True:
        c, _ = s.accept()
        threading.Thread(target=lambda c=c: [c.sendall(b) for b in iter(lambda: c.recv(100), b"")], daemon=True).start()
for p in sys.argv[1:]:
    threading.Thread(target=serve, args=(int(p),), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""
# In the guest's place: one open connection per target, an echo checked at once and again on each line read.
HOLD = """
import socket, sys
conns = {t: socket.create_connection((t.split(":")[0], int(t.split(":")[1])), timeout=5) for t in sys.argv[1:]}
def echo():
    out = {}
    for t, c in conns.items():
        try:
            c.sendall(b"ping"); out[t] = c.recv(100).decode() or "closed"
        except OSError as e:
            out[t] = type(e).__name__
    print(repr(out), flush=True)
echo()
for _ in sys.stdin:
    echo()
"""


def _policy(*rules: str) -> NetworkPolicy:
    return NetworkPolicy.from_json({"mode": "allowlist", "egress": list(rules)})


def _ruleset(ns: str) -> str:
    return sh(*in_ns(ns, "nft", "list", "ruleset"))


@pytest.fixture
def echo(routed: dict[str, Any]) -> Iterator[dict[str, Any]]:  # noqa: F811
    """A second peer address (`third`) and echo servers on 8081 and 8082 in the peer namespace."""
    third = routed["other"].rsplit(".", 1)[0] + ".3"
    sh("ip", "-n", routed["peer"], "addr", "add", f"{third}/24", "dev", "pp0")
    server = subprocess.Popen(
        in_ns(routed["peer"], sys.executable, "-c", ECHO, "8081", "8082"), stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield {**routed, "third": third}
    finally:
        server.kill()
        server.wait(10)


@needs_net
def test_a_new_policy_replaces_the_old_whole_and_cuts_open_connections_to_what_it_takes_away(
    echo: dict[str, Any],
) -> None:
    sid = f"nu-{uuid.uuid4().hex[:8]}"
    other, third = echo["other"], echo["third"]
    before = _policy(f"{other}/32:8080", f"{other}/32:8081", f"{other}/32:8082")
    after = _policy(f"{third}/32:8080", f"{other}/32:8080", f"{other}/32:8082")
    net = netpolicy.setup(sid, before, node="n1", uplink_netns=echo["uplink"])
    holder = None
    try:
        stand_in_guest(net.netns, echo["guest"])
        assert probe(echo["guest"], f"{other}:8080", f"{third}:8080") == {
            f"{other}:8080": f"hello from {other}",
            f"{third}:8080": "ConnectionRefusedError",
        }
        cut, kept = f"{other}:8081", f"{other}:8082"
        holder = subprocess.Popen(
            in_ns(echo["guest"], sys.executable, "-c", HOLD, cut, kept),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdin is not None and holder.stdout is not None
        assert holder.stdout.readline().strip() == repr({cut: "ping", kept: "ping"})

        netpolicy.apply(sid, after, netpolicy.node_addresses(echo["uplink"]))

        rules = _ruleset(net.netns)
        assert f"{third} tcp dport 8080" in rules and f"{other} tcp dport 8082" in rules
        assert "dport 8081" not in rules  # replaced whole, not added to
        assert probe(echo["guest"], f"{other}:8080", f"{third}:8080", f"{other}:8081") == {
            f"{other}:8080": f"hello from {other}",
            f"{third}:8080": f"hello from {third}",
            f"{other}:8081": "ConnectionRefusedError",
        }
        holder.stdin.write("again\n")
        holder.stdin.flush()
        # the connection the new policy no longer allows is reset; the one it still allows carries on
        assert holder.stdout.readline().strip() == repr({cut: "ConnectionResetError", kept: "ping"})
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(10)
        netpolicy.teardown(sid, node="n1", uplink_netns=echo["uplink"])


@needs_net
def test_a_ruleset_that_fails_to_load_leaves_the_old_one_in_force(
    routed: dict[str, Any],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sid = f"nu-{uuid.uuid4().hex[:8]}"
    other = routed["other"]
    net = netpolicy.setup(sid, _policy(f"{other}/32:8080"), node="n1", uplink_netns=routed["uplink"])
    try:
        stand_in_guest(net.netns, routed["guest"])
        loaded = _ruleset(net.netns)
        whole = netpolicy.ruleset
        # a ruleset that flushes, rebuilds most of itself, then fails on its last line: nft loads all or nothing
        monkeypatch.setattr(netpolicy, "ruleset", lambda p, a: whole(p, a) + "add rule inet cube nosuchchain drop\n")
        with pytest.raises(CubeError) as e:
            netpolicy.apply(sid, NetworkPolicy(), netpolicy.node_addresses(routed["uplink"]))
        assert e.value.code == "network.setup_failed"
        assert _ruleset(net.netns) == loaded
        assert probe(routed["guest"], f"{other}:8080") == {f"{other}:8080": f"hello from {other}"}
    finally:
        netpolicy.teardown(sid, node="n1", uplink_netns=routed["uplink"])


def _asked(body: dict[str, Any]) -> NetworkRequest:
    return NetworkRequest.parse(body)


def _running(node: Node, sid: str, template_egress: list[str]) -> None:
    contract = _tool_contract({"network": {"mode": "allowlist", "egress": template_egress}})
    node.cubelet.reserve(sid, ReservationRequest(contract=contract))
    node.cubelet.start(sid)
    poll(lambda: node.cubelet.get_reservation(sid).phase is ReservationPhase.RUNNING, 20)


def _record_network(node: Node, sid: str, net: netpolicy.SandboxNet) -> None:
    """As the Cubelet's start path records it (the simulated shim builds none)."""
    with node.cubelet.store.tx() as t:
        cur = t.reservation(sid)
        assert cur is not None
        cur.checkpoint.network = net.to_json()
        t.update_reservation(cur)


@needs_net
def test_a_change_is_journaled_and_the_reconcile_pass_loads_what_the_journal_says(
    routed: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    """The simulated node journals but builds no network; a namespace built here stands for what a Cubelet that
    died between journal and load left: the reconcile pass loads the journaled policy."""
    node = Node.create(tmp_path, "h100x1")
    sid = f"nu-{uuid.uuid4().hex[:8]}"
    subnet, other = routed["node"].rsplit(".", 1)[0], routed["other"]
    _running(node, sid, [f"{subnet}.0/24:8080"])
    res = node.cubelet.get_reservation(sid)
    assert res.params.network is not None
    net = netpolicy.setup(sid, res.params.network, node="n1", uplink_netns=routed["uplink"])
    try:
        _record_network(node, sid, net)
        stand_in_guest(net.netns, routed["guest"])
        reconcile(node.cubelet)
        assert probe(routed["guest"], f"{other}:8080") == {f"{other}:8080": f"hello from {other}"}

        network_update.set_network(node.cubelet, sid, _asked({"allow_out": [], "deny_out": [f"{other}/32"]}))

        res = node.cubelet.get_reservation(sid)
        assert res.params.network is not None
        egress = [str(r) for r in res.params.network.egress]
        assert f"{other}/32:8080/tcp" not in egress and res.checkpoint.network is not None
        assert res.checkpoint.network["egress"] == egress
        (ev,) = [e for e in node.cubelet.store.events(sandbox_id=sid) if e.kind == "network_updated"]
        assert ev.details["egress"] == egress and ev.details["previous"] == [f"{subnet}.0/24:8080/tcp"]
        reconcile(node.cubelet)
        assert probe(routed["guest"], f"{other}:8080") == {f"{other}:8080": "ConnectionRefusedError"}
    finally:
        netpolicy.teardown(sid, node="n1", uplink_netns=routed["uplink"])


@needs_net
def test_a_change_that_fails_to_load_is_set_back_in_the_journal(
    routed: dict[str, Any],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = Node.create(tmp_path, "h100x1")
    sid = f"nu-{uuid.uuid4().hex[:8]}"
    other = routed["other"]
    _running(node, sid, [f"{other}/32:8080"])
    res = node.cubelet.get_reservation(sid)
    assert res.params.network is not None
    net = netpolicy.setup(sid, res.params.network, node="n1", uplink_netns=routed["uplink"])
    try:
        _record_network(node, sid, net)
        monkeypatch.setattr(node.shim, "host_devices", True)  # as a real node: the change is loaded at once
        network_update.set_network(node.cubelet, sid, _asked({"allow_out": [], "deny_out": [f"{other}/32"]}))
        assert network_update.recorded_policy(node.cubelet.get_reservation(sid)) == NetworkPolicy()
        assert "dport 8080" not in _ruleset(net.netns)  # a NIC that may reach nothing

        def broken(*args: Any) -> None:
            raise CubeError("network.setup_failed", "nft: simulated refusal")

        monkeypatch.setattr(netpolicy, "apply", broken)
        with pytest.raises(CubeError) as e:
            network_update.set_network(node.cubelet, sid, _asked({"allow_out": [], "deny_out": []}))
        assert e.value.code == "network.setup_failed"
        assert network_update.recorded_policy(node.cubelet.get_reservation(sid)) == NetworkPolicy()
        kinds = [e.kind for e in node.cubelet.store.events(sandbox_id=sid) if e.kind.startswith("network_update")]
        assert kinds == ["network_updated", "network_updated", "network_update_failed"]
    finally:
        netpolicy.teardown(sid, node="n1", uplink_netns=routed["uplink"])


def test_changes_the_cubelet_refuses_leave_the_journal_as_it_was(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "h100x2")
    _running(node, "wide", ["10.0.0.0/8:443"])
    before = node.cubelet.get_reservation("wide").params.to_json()
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("wide", {"mode": "allowlist", "egress": ["10.0.0.0/7:443"]}, "network.policy_widened"),
        ("wide", {"allow_out": ["192.0.2.1"], "deny_out": []}, "network.policy_widened"),
    ]
    for sid, body, code in cases:
        with pytest.raises(CubeError) as e:
            network_update.set_network(node.cubelet, sid, _asked(body))
        assert e.value.code == code
    assert node.cubelet.get_reservation("wide").params.to_json() == before
    assert not [e for e in node.cubelet.store.events(sandbox_id="wide") if e.kind.startswith("network_update")]
    node.cubelet.reserve("held", ReservationRequest(contract=_tool_contract({})))  # reserved, never started
    with pytest.raises(CubeError) as e:
        network_update.set_network(node.cubelet, "held", _asked({"allow_out": [], "deny_out": []}))
    assert e.value.code == "network.not_running"


@needs_net
def test_a_sandbox_started_without_a_nic_is_given_no_egress_while_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = Node.create(tmp_path, "h100x1")
    contract = _tool_contract({"network": {"mode": "allowlist", "egress": ["192.0.2.0/24:443"]}})
    closed = _asked({"allow_out": [], "deny_out": ["0.0.0.0/0"]})
    node.cubelet.reserve("closed", ReservationRequest(contract=contract, network=closed))
    node.cubelet.start("closed")
    poll(lambda: node.cubelet.get_reservation("closed").phase is ReservationPhase.RUNNING, 20)
    monkeypatch.setattr(node.shim, "host_devices", True)  # as a real node, which built no NIC for this policy
    with pytest.raises(CubeError) as e:
        network_update.set_network(node.cubelet, "closed", _asked({"allow_out": [], "deny_out": []}))
    assert e.value.code == "network.no_nic" and e.value.details["egress"] == ["192.0.2.0/24:443/tcp"]
    assert node.cubelet.get_reservation("closed").params.network is None
    network_update.set_network(node.cubelet, "closed", closed)  # still nothing: nothing to build, accepted
