"""Sandbox networks on the host (real namespaces, TAP and nftables; no VM) and the Cubelet's policy refusals."""

from __future__ import annotations

import copy
import fcntl
import ipaddress
import json
import os
import shutil
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.release import CubeletConfig
from cubeaccel.host.net import netpolicy
from cubeaccel.model.contract import CompatibilityContract, freeze
from cubeaccel.model.reservation_params import NetworkRequest
from cubeaccel.model.sandbox_policy import NetworkPolicy
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.templates import load_document, parse_template
from tests.support.cubelet_harness import Node

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "cubeaccel" / "examples" / "templates"
TUNGETIFF = 0x800454D2
POLICY = NetworkPolicy.from_json({"mode": "allowlist", "egress": ["192.0.2.10/32:8080", "198.51.100.0/24:53/udp"]})

needs_net = pytest.mark.skipif(
    os.geteuid() != 0 or netpolicy.available() is not None, reason=f"needs root, ip and nft: {netpolicy.available()}"
)


def ip_json(*args: str) -> Any:
    return json.loads(subprocess.run(["ip", "-j", *args], check=True, capture_output=True, text=True).stdout or "[]")


@pytest.fixture
def uplink() -> Iterator[str]:
    ns = f"cbt-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


@needs_net
def test_setup_builds_namespace_tap_uplink_and_rules_and_teardown_removes_them(uplink: str) -> None:
    sid = f"np-{uuid.uuid4().hex[:8]}"
    net = netpolicy.setup(sid, POLICY, node="n1", uplink_netns=uplink)
    try:
        ns = net.netns
        links = {x["ifname"]: x for x in ip_json("-n", ns, "link", "show")}
        assert set(links) == {"lo", "tap0", "up0"}
        addrs = {x["ifname"]: [a["local"] for a in x["addr_info"]] for x in ip_json("-n", ns, "-4", "addr", "show")}
        assert addrs["tap0"] == [net.gateway]
        routes = ip_json("-n", ns, "route", "show")
        assert [r["dst"] for r in routes if r["dst"] == "default"] == ["default"]
        rules = subprocess.run(
            ["ip", "netns", "exec", ns, "nft", "list", "ruleset"], check=True, capture_output=True, text=True
        ).stdout
        assert (
            "policy drop" in rules and "192.0.2.10 tcp dport 8080" in rules and "198.51.100.0/24 udp dport 53" in rules
        )
        assert "masquerade" in rules and "meta nfproto ipv6 drop" in rules
        v6 = subprocess.run(
            ["ip", "netns", "exec", ns, "cat", "/proc/sys/net/ipv6/conf/all/disable_ipv6"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        assert v6.strip() == "1"
        assert net.uplink_if in {x["ifname"] for x in ip_json("-n", uplink, "link", "show")}
        # the shim's way in: an fd on the TAP, opened inside the namespace, while this thread stays where it was
        before = os.readlink("/proc/thread-self/ns/net")
        fd = netpolicy.open_tap(netpolicy.NETNS_DIR / ns, "tap0")
        try:
            name = fcntl.ioctl(fd, TUNGETIFF, b"\0" * 40)
            assert struct.unpack("16s", name[:16])[0].rstrip(b"\0") == b"tap0"
            assert os.readlink("/proc/thread-self/ns/net") == before
        finally:
            os.close(fd)
    finally:
        assert netpolicy.teardown(sid, node="n1", uplink_netns=uplink)
    assert not netpolicy.exists(sid)
    assert {x["ifname"] for x in ip_json("-n", uplink, "link", "show")} == {"lo"}
    assert not netpolicy.teardown(sid, node="n1", uplink_netns=uplink)  # idempotent


@needs_net
def test_two_sandboxes_get_distinct_uplink_addresses(uplink: str) -> None:
    sids = [f"np-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    nets = []
    try:
        for sid in sids:
            nets.append(netpolicy.setup(sid, POLICY, node="n1", uplink_netns=uplink, pool="100.96.0.0/29"))
        assert len({n.veth_cidr for n in nets}) == 2
    finally:
        for sid in sids:
            netpolicy.teardown(sid, node="n1", uplink_netns=uplink)


def test_the_ruleset_allows_only_the_listed_destinations_and_never_the_node() -> None:
    node = [ipaddress.IPv4Address("192.0.2.10"), ipaddress.IPv4Address("10.0.0.5")]
    text = netpolicy.ruleset(POLICY, node)
    assert "elements = { 10.0.0.5, 192.0.2.10 }" in text
    forward = [line.strip() for line in text.split("chain forward")[1].splitlines()]
    refuse = forward.index('iifname "tap0" ip daddr @node meta l4proto tcp reject with tcp reset')
    assert refuse < min(i for i, line in enumerate(forward) if "ct state new,established accept" in line)
    accepts = [line.strip() for line in text.splitlines() if "ct state new,established accept" in line]
    assert accepts == [
        'iifname "tap0" oifname "up0" ip daddr 192.0.2.10/32 tcp dport 8080 ct state new,established accept',
        'iifname "tap0" oifname "up0" ip daddr 198.51.100.0/24 udp dport 53 ct state new,established accept',
    ]
    assert "policy drop" in text.split("chain input")[1].split("}")[0]


SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(); print("ready", flush=True)
while True:
    c, _ = s.accept(); c.sendall(("hello from " + c.getsockname()[0]).encode()); c.close()
"""
PROBE = """
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as c:
            out[target] = c.recv(100).decode()
    except OSError as e:
        out[target] = type(e).__name__
print(json.dumps(out))
"""


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=30).stdout


def in_ns(ns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


@pytest.fixture
def routed(uplink: str) -> Iterator[dict[str, Any]]:
    """The uplink namespace plays the node (it routes, and has an address and a listener of its own on the test
    subnet); a peer namespace on that subnet is a destination the allowlist names. Private addresses only."""
    run = uuid.uuid4().hex[:8]
    peer, guest = f"cbp-{run}", f"cbg-{run}"
    subnet = f"10.251.{int(run[:2], 16)}"
    servers: list[subprocess.Popen[str]] = []
    try:
        for ns in (peer, guest):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", uplink, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", uplink, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        sh("ip", "-n", uplink, "link", "add", "pu0", "type", "veth", "peer", "name", "pp0", "netns", peer)
        sh("ip", "-n", uplink, "addr", "add", f"{subnet}.1/24", "dev", "pu0")
        sh("ip", "-n", peer, "addr", "add", f"{subnet}.2/24", "dev", "pp0")
        sh("ip", "-n", uplink, "link", "set", "pu0", "up")
        sh("ip", "-n", peer, "link", "set", "pp0", "up")
        sh("ip", "-n", peer, "route", "add", "default", "via", f"{subnet}.1")
        for ns in (uplink, peer):
            server = subprocess.Popen(
                in_ns(ns, sys.executable, "-c", SERVER, "8080"), stdout=subprocess.PIPE, text=True
            )
            servers.append(server)
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield {"uplink": uplink, "peer": peer, "guest": guest, "node": f"{subnet}.1", "other": f"{subnet}.2"}
    finally:
        for server in servers:
            server.kill()
            server.wait(10)
        for ns in (peer, guest):
            subprocess.run(["ip", "netns", "del", ns], check=False, timeout=30)


def stand_in_guest(sandbox_ns: str, guest_ns: str) -> None:
    """A namespace in the guest's place: the TAP becomes a veth whose far end is the guest's eth0, so the guest's
    packets cross the sandbox namespace's forward chain exactly as a VM's would."""
    sh("ip", "-n", sandbox_ns, "link", "del", "tap0")
    sh("ip", "-n", sandbox_ns, "link", "add", "tap0", "type", "veth", "peer", "name", "eth0", "netns", guest_ns)
    sh("ip", "-n", sandbox_ns, "addr", "add", f"{netpolicy.GATEWAY_ADDR}/30", "dev", "tap0")
    sh("ip", "-n", sandbox_ns, "link", "set", "tap0", "up")
    sh("ip", "-n", guest_ns, "addr", "add", f"{netpolicy.GUEST_ADDR}/30", "dev", "eth0")
    sh("ip", "-n", guest_ns, "link", "set", "eth0", "up")
    sh("ip", "-n", guest_ns, "route", "add", "default", "via", netpolicy.GATEWAY_ADDR)


def probe(ns: str, *targets: str) -> dict[str, str]:
    return dict(json.loads(sh(*in_ns(ns, sys.executable, "-c", PROBE, *targets))))


@needs_net
def test_an_allowlist_containing_a_node_address_reaches_the_peer_but_never_the_node(routed: dict[str, Any]) -> None:
    sid = f"np-{uuid.uuid4().hex[:8]}"
    node, other = routed["node"], routed["other"]
    policy = NetworkPolicy.from_json({"mode": "allowlist", "egress": [f"{node.rsplit('.', 1)[0]}.0/24:8080"]})
    net = netpolicy.setup(sid, policy, node="n1", uplink_netns=routed["uplink"])
    try:
        stand_in_guest(net.netns, routed["guest"])
        got = probe(routed["guest"], f"{other}:8080", f"{node}:8080")
        assert got == {f"{other}:8080": f"hello from {other}", f"{node}:8080": "ConnectionRefusedError"}
        # the uplink end of the sandbox's own veth is the node's too
        uplink_end = str(ipaddress.IPv4Interface(net.veth_cidr).ip + 1)
        assert ipaddress.IPv4Address(uplink_end) in netpolicy.node_addresses(routed["uplink"])
        # an address the node gains later is refused once the ruleset is loaded again (the Cubelet's reconcile pass)
        later = node.rsplit(".", 1)[0] + ".77"
        sh("ip", "-n", routed["uplink"], "addr", "add", f"{later}/24", "dev", "pu0")
        assert probe(routed["guest"], f"{later}:8080") == {f"{later}:8080": f"hello from {later}"}
        now = netpolicy.node_addresses(routed["uplink"])
        assert ipaddress.IPv4Address(later) in now
        netpolicy.apply(sid, policy, now)
        got = probe(routed["guest"], f"{later}:8080", f"{node}:8080", f"{other}:8080")
        assert got == {
            f"{later}:8080": "ConnectionRefusedError",
            f"{node}:8080": "ConnectionRefusedError",
            f"{other}:8080": f"hello from {other}",
        }
    finally:
        netpolicy.teardown(sid, node="n1", uplink_netns=routed["uplink"])


@needs_net
def test_the_cubelets_reconcile_pass_refuses_an_address_the_node_gains_later(
    routed: dict[str, Any], tmp_path: Path
) -> None:
    from cubeaccel.cubelet.reconcile import reconcile

    node = Node.create(tmp_path, "h100x1")
    sid = f"np-{uuid.uuid4().hex[:8]}"
    subnet = routed["node"].rsplit(".", 1)[0]
    allow = {"network": {"mode": "allowlist", "egress": [f"{subnet}.0/24:8080"]}}
    res = node.cubelet.reserve(sid, ReservationRequest(contract=_tool_contract(allow)))
    assert res.params.network is not None
    net = netpolicy.setup(sid, res.params.network, node="n1", uplink_netns=routed["uplink"])
    try:
        with node.cubelet.store.tx() as t:  # as the Cubelet's start path records it (the simulated shim builds none)
            cur = t.reservation(sid)
            assert cur is not None
            cur.checkpoint.network = net.to_json()
            t.update_reservation(cur)
        stand_in_guest(net.netns, routed["guest"])
        later = f"{subnet}.78"
        sh("ip", "-n", routed["uplink"], "addr", "add", f"{later}/24", "dev", "pu0")
        assert probe(routed["guest"], f"{later}:8080") == {f"{later}:8080": f"hello from {later}"}
        reconcile(node.cubelet)
        got = probe(routed["guest"], f"{later}:8080", f"{routed['other']}:8080")
        assert got == {
            f"{later}:8080": "ConnectionRefusedError",
            f"{routed['other']}:8080": f"hello from {routed['other']}",
        }
    finally:
        netpolicy.teardown(sid, node="n1", uplink_netns=routed["uplink"])


def _tool_contract(sandbox: dict[str, Any]) -> CompatibilityContract:
    doc = copy.deepcopy(load_document(EXAMPLES / "cuda12-h100.yaml"))
    assert isinstance(doc, dict)
    doc["spec"]["sandbox"] = sandbox
    return freeze(parse_template(doc))


def test_cubelet_refuses_mounts_the_operator_did_not_allowlist(tmp_path: Path) -> None:
    mounts = {"filesystem": {"readonly_mounts": [{"source": "/srv/models/llama", "target": "/models"}]}}
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    node = Node.create(tmp_path / "a", "h100x1")
    with pytest.raises(CubeError) as e:
        node.cubelet.reserve("sb", ReservationRequest(contract=_tool_contract(mounts)))
    assert e.value.code == "filesystem.mount_not_allowlisted" and e.value.status == 409
    assert node.cubelet.store.reservation("sb") is None
    cfg = CubeletConfig(pinnable_memory_mib=1 << 20, readonly_mount_allowlist=("/srv/models",))
    allowed = Node.create(tmp_path / "b", "h100x1", config=cfg)
    assert allowed.cubelet.reserve("sb", ReservationRequest(contract=_tool_contract(mounts))).device_ids


def _asked(egress: list[str]) -> NetworkRequest:
    return NetworkRequest.parse({"mode": "allowlist", "egress": egress})


def test_cubelet_narrows_records_and_refuses_pool_overlap_and_widening(tmp_path: Path) -> None:
    net = {"network": {"mode": "allowlist", "egress": ["10.0.0.0/8:443"]}}
    node = Node.create(tmp_path, "h100x2")
    res = node.cubelet.reserve(
        "sb1",
        ReservationRequest(contract=_tool_contract(net), network=_asked(["10.1.0.0/16:443"])),
    )
    assert res.params.to_json()["network"] == {"mode": "allowlist", "egress": ["10.1.0.0/16:443/tcp"]}
    with pytest.raises(CubeError) as e:
        node.cubelet.reserve(
            "sb2",
            ReservationRequest(contract=_tool_contract(net), network=_asked(["10.0.0.0/7:443"])),
        )
    assert e.value.code == "network.policy_widened"
    pool = {"network": {"mode": "allowlist", "egress": ["100.96.4.0/24:443"]}}
    with pytest.raises(CubeError) as e:
        node.cubelet.reserve("sb3", ReservationRequest(contract=_tool_contract(pool)))
    assert e.value.code == "network.pool_overlap"


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="e2fsprogs missing")
def test_the_scratch_disk_is_sparse_and_exactly_the_cap(tmp_path: Path) -> None:
    from cubeaccel.host.vmm.scratch import SCRATCH_FILE, create_scratch, remove_scratch

    create_scratch(tmp_path / SCRATCH_FILE, 64)
    st = (tmp_path / SCRATCH_FILE).stat()
    assert st.st_size == 64 << 20 and st.st_blocks * 512 < 16 << 20
    assert remove_scratch(tmp_path) and not (tmp_path / SCRATCH_FILE).exists() and not remove_scratch(tmp_path)
