"""A sandbox's network: its own namespace, a TAP for the guest, a veth uplink and nftables rules that drop the rest.

    guest eth0 169.254.100.2/30 ─ tap0 169.254.100.1/30 [netns cube-<sandbox>] up0 P+1/30 ─ veth P+2/30 [uplink]

The guest link is link-local on purpose: no allowlist can name link-local, so no rule can overlap it. The
namespace forwards only the guest's packets to the allowlisted `CIDR:port/proto`s (and their replies), masquerading
them to its veth address; everything else from the guest is rejected (TCP reset, ICMP admin-prohibited), the
namespace itself accepts nothing from the guest, and IPv6 is off. The node itself is never a destination, whatever
the allowlist: every address (and broadcast) on every interface of the uplink namespace is in the set `node`,
rejected before any allow rule — read when the sandbox's network is built and re-read by `refresh_node_addresses`
(the Cubelet's reconcile pass), so an allowlist CIDR that contains a host address reaches the rest of the CIDR
only. The uplink is the host's namespace (production:
the operator routes the pool onward) or a named one (tests: a namespace with nothing beyond it). Each sandbox
takes one /30 of the node's pool for its veth; allowlists overlapping the pool are refused (other sandboxes).

The rules are one ruleset, always loaded whole (`apply`: one `nft -f` transaction that flushes and rebuilds it),
so a changed policy (`PUT …/network`) replaces the old one atomically: no moment has neither, and a ruleset that
fails to load leaves the old one in force. An established connection is judged by the allowlist too (only its
replies are let in by connection state): a destination a changed policy takes away is cut at once, open
connections included (the guest's next packet there is answered with a reset), while connections the new
policy still allows carry on.

The TAP is persistent in the sandbox namespace; the shim opens it there (`open_tap`) and hands QEMU the fd, so
the VMM needs neither /dev/net/tun nor CAP_NET_ADMIN. Removing the namespace removes TAP, veth and rules.
"""

from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import json
import os
import shutil
import struct
import subprocess
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from fcntl import ioctl
from pathlib import Path
from typing import Any

from cubeaccel.host.service.childenv import tool_env
from cubeaccel.model.sandbox_policy import NetworkPolicy
from cubeaccel.protocol.errors import CubeError

NETNS_DIR = Path("/run/netns")
GUEST_ADDR = "169.254.100.2"
GATEWAY_ADDR = "169.254.100.1"
LINK_PREFIX = 30
TAP = "tap0"
UPLINK_IF = "up0"
NODE_SET = "node"  # nft set: the node's own addresses, never a destination
DEFAULT_POOL = "100.96.0.0/16"
CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
CMD_TIMEOUT_S = 10.0


def net_error(code: str, message: str, **details: Any) -> CubeError:
    return CubeError(code, message, "cubelet", details, 409 if code == "network.unavailable" else 500)


def available() -> str | None:
    """None when this host can build sandbox networks; else why not."""
    missing = [t for t in ("ip", "nft") if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install iproute2 nftables)"
    if not Path("/dev/net/tun").exists():
        return "no /dev/net/tun"
    return None


def netns_name(sandbox_id: str) -> str:
    return f"cube-{sandbox_id}"


def uplink_ifname(sandbox_id: str, node: str) -> str:
    return "cbu" + hashlib.sha256(f"{node}/{sandbox_id}".encode()).hexdigest()[:11]  # ≤ 15 bytes (IFNAMSIZ)


def guest_mac(sandbox_id: str) -> str:
    h = hashlib.sha256(sandbox_id.encode()).digest()
    return "52:54:00:" + ":".join(f"{b:02x}" for b in h[:3])


@dataclass(frozen=True)
class SandboxNet:
    """What was built for one sandbox (recorded in the reservation, given to the shim)."""

    netns: str
    tap: str
    guest_cidr: str
    gateway: str
    mac: str
    uplink_if: str
    uplink_netns: str | None  # None: the host's own namespace
    veth_cidr: str  # the sandbox's end; the uplink's is the next address
    egress: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {
            "netns": self.netns,
            "tap": self.tap,
            "guest_cidr": self.guest_cidr,
            "gateway": self.gateway,
            "mac": self.mac,
            "uplink_if": self.uplink_if,
            "uplink_netns": self.uplink_netns,
            "veth_cidr": self.veth_cidr,
            "egress": list(self.egress),
        }


@dataclass(frozen=True)
class Loaded:
    """What a sandbox's namespace holds: the policy and the node addresses its ruleset was last loaded with."""

    policy: NetworkPolicy
    node: frozenset[ipaddress.IPv4Address]


def _run(args: list[str], stdin: str | None = None) -> str:
    try:
        p = subprocess.run(
            args,
            input=stdin,
            env=tool_env(),
            capture_output=True,
            text=True,
            timeout=CMD_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise net_error("network.setup_failed", f"{' '.join(args[:4])}: {e}") from e
    if p.returncode != 0:
        raise net_error("network.setup_failed", f"{' '.join(args)}: {p.stderr.strip()[-300:]}", argv=args)
    return p.stdout


def _ip(netns: str | None, *args: str) -> str:
    return _run(["ip", *(["-n", netns] if netns else []), *args])


def _elements(addresses: Iterable[ipaddress.IPv4Address]) -> str:
    return ", ".join(str(a) for a in sorted(set(addresses)))


def ruleset(policy: NetworkPolicy, node_addresses: Iterable[ipaddress.IPv4Address] = ()) -> str:
    """The namespace's whole nftables ruleset (it is the only one there): allowlist forward, masquerade, drop.
    `node_addresses` (the uplink namespace's own) are refused before any allow rule. The guest's packets pass
    only by the allowlist, new or established (an established connection is not waved through by its state, so
    a policy that no longer allows its destination cuts it); replies pass by connection state."""
    allow = [
        f'    iifname "{TAP}" oifname "{UPLINK_IF}" ip daddr {r.network} {r.proto} dport {r.port}'
        " ct state new,established accept"
        for r in policy.egress
    ]
    elements = _elements(node_addresses)
    lines = [
        "flush ruleset",
        "table inet cube {",
        f"  set {NODE_SET} {{",
        "    type ipv4_addr;",
        *([f"    elements = {{ {elements} }}"] if elements else []),
        "  }",
        "  chain input {",
        "    type filter hook input priority 0; policy drop;",
        '    iifname "lo" accept',
        "  }",
        "  chain output {",
        "    type filter hook output priority 0; policy drop;",
        '    oifname "lo" accept',
        "    ct state established,related accept",
        '    oifname "tap0" meta l4proto { icmp, tcp } accept',  # the rejects below answer the guest
        "  }",
        "  chain forward {",
        "    type filter hook forward priority 0; policy drop;",
        "    meta nfproto ipv6 drop",
        f'    iifname "{UPLINK_IF}" oifname "{TAP}" ct state established,related accept',
        f'    iifname "{TAP}" ip daddr @{NODE_SET} meta l4proto tcp reject with tcp reset',
        f'    iifname "{TAP}" ip daddr @{NODE_SET} reject with icmpx type admin-prohibited',
        *allow,
        f'    iifname "{TAP}" meta l4proto tcp reject with tcp reset',
        f'    iifname "{TAP}" reject with icmpx type admin-prohibited',
        "  }",
        "}",
        "table ip cubenat {",
        "  chain post {",
        "    type nat hook postrouting priority 100; policy accept;",
        f'    oifname "{UPLINK_IF}" masquerade',
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def _taken(uplink_netns: str | None) -> set[ipaddress.IPv4Address]:
    out = json.loads(_ip(uplink_netns, "-j", "-4", "addr", "show") or "[]")
    return {ipaddress.IPv4Address(a["local"]) for link in out for a in link.get("addr_info", []) if "local" in a}


def node_addresses(uplink_netns: str | None) -> set[ipaddress.IPv4Address]:
    """Every IPv4 address the node itself answers on: each interface's own addresses and broadcasts in the uplink
    namespace (the host's, in production), read now."""
    out = json.loads(_ip(uplink_netns, "-j", "-4", "addr", "show") or "[]")
    return {
        ipaddress.IPv4Address(a[key])
        for link in out
        for a in link.get("addr_info", [])
        for key in ("local", "broadcast")
        if key in a
    }


def apply(sandbox_id: str, policy: NetworkPolicy, addresses: Iterable[ipaddress.IPv4Address]) -> None:
    """Load the sandbox's whole ruleset for `policy`, refusing `addresses` (the node's as they are now,
    `node_addresses`): one nft transaction that flushes and rebuilds it, so the old ruleset stays in force until
    the new one is complete, and stays whole if the new one fails to load (`network.setup_failed`)."""
    _run(["ip", "netns", "exec", netns_name(sandbox_id), "nft", "-f", "-"], stdin=ruleset(policy, addresses))


def _slot(sandbox_id: str, pool: ipaddress.IPv4Network, uplink_netns: str | None) -> ipaddress.IPv4Network:
    """This sandbox's /30 in the pool: from its id's hash, the next free one (by the uplink's addresses)."""
    n = pool.num_addresses // 4
    start = int.from_bytes(hashlib.sha256(sandbox_id.encode()).digest()[:4], "big") % n
    taken = _taken(uplink_netns)
    for i in range(n):
        net = ipaddress.IPv4Network((int(pool.network_address) + 4 * ((start + i) % n), 30))
        if not set(net) & taken:
            return net
    raise net_error("network.setup_failed", f"the sandbox pool {pool} is full")


def setup(
    sandbox_id: str,
    policy: NetworkPolicy,
    *,
    node: str,
    pool: str = DEFAULT_POOL,
    uplink_netns: str | None = None,
    tap_owner: int | None = None,
) -> SandboxNet:
    """Build the namespace, TAP, uplink and rules; on any failure, remove what was built and raise."""
    if (why := available()) is not None:
        raise net_error("network.unavailable", f"cannot build sandbox networks here: {why}")
    ns, upif = netns_name(sandbox_id), uplink_ifname(sandbox_id, node)
    teardown(sandbox_id, node=node, uplink_netns=uplink_netns)  # a half-built one from a crashed start
    try:
        _ip(None, "netns", "add", ns)
        _ip(ns, "link", "set", "lo", "up")
        _run(["ip", "netns", "exec", ns, "sh", "-c", _SYSCTLS])
        tap_args = ["tuntap", "add", "dev", TAP, "mode", "tap"]
        if tap_owner is not None:  # a VMM under its own uid may then open it itself (fd passing needs no owner)
            tap_args += ["user", str(tap_owner)]
        _ip(ns, *tap_args)
        _ip(ns, "addr", "add", f"{GATEWAY_ADDR}/{LINK_PREFIX}", "dev", TAP)
        _ip(ns, "link", "set", TAP, "up")
        slot = _slot(sandbox_id, ipaddress.IPv4Network(pool), uplink_netns)
        ours, theirs = slot.network_address + 1, slot.network_address + 2
        peer_ns = uplink_netns if uplink_netns else str(os.getpid())
        _ip(ns, "link", "add", UPLINK_IF, "type", "veth", "peer", "name", upif, "netns", peer_ns)
        _ip(ns, "addr", "add", f"{ours}/30", "dev", UPLINK_IF)
        _ip(ns, "link", "set", UPLINK_IF, "up")
        _ip(ns, "route", "add", "default", "via", str(theirs))
        _ip(uplink_netns, "addr", "add", f"{theirs}/30", "dev", upif)
        _ip(uplink_netns, "link", "set", upif, "up")
        # read last: the uplink end of this sandbox's own veth is one of the node's addresses too
        apply(sandbox_id, policy, node_addresses(uplink_netns))
    except CubeError:
        teardown(sandbox_id, node=node, uplink_netns=uplink_netns)
        raise
    return SandboxNet(
        netns=ns,
        tap=TAP,
        guest_cidr=f"{GUEST_ADDR}/{LINK_PREFIX}",
        gateway=GATEWAY_ADDR,
        mac=guest_mac(sandbox_id),
        uplink_if=upif,
        uplink_netns=uplink_netns,
        veth_cidr=f"{ours}/30",
        egress=tuple(str(r) for r in policy.egress),
    )


# Forwarding on (this namespace only), IPv6 off: the guest speaks IPv4 to its allowlist and nothing else.
_SYSCTLS = (
    "echo 1 > /proc/sys/net/ipv4/ip_forward && echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6"
    " && echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"
)


def exists(sandbox_id: str) -> bool:
    return (NETNS_DIR / netns_name(sandbox_id)).exists()


def teardown(sandbox_id: str, *, node: str, uplink_netns: str | None = None) -> bool:
    """Remove the namespace (TAP, veth pair and rules go with it) and a leftover uplink end. Idempotent; True
    when something was there. The kernel frees the namespace once the VMM holding the TAP has exited."""
    found = False
    if exists(sandbox_id):
        found = True
        _ip(None, "netns", "del", netns_name(sandbox_id))
    upif = uplink_ifname(sandbox_id, node)
    if (uplink_netns is None or (NETNS_DIR / uplink_netns).exists()) and _has_link(uplink_netns, upif):
        found = True
        try:
            _ip(uplink_netns, "link", "del", upif)
        except CubeError:
            if _has_link(uplink_netns, upif):  # not the kernel's own cleanup of the namespace racing us
                raise
    return found


def _has_link(netns: str | None, name: str) -> bool:
    return any(link.get("ifname") == name for link in json.loads(_ip(netns, "-j", "link", "show") or "[]"))


def open_tap(netns_path: Path, name: str) -> int:
    """An fd on the TAP `name` inside the namespace at `netns_path`, for QEMU's `-netdev tap,fd=`.

    setns(2) applies to the calling thread only, so it is done in a short-lived thread: the caller's own
    namespace never changes."""
    libc = ctypes.CDLL(None, use_errno=True)
    result: dict[str, Any] = {}

    def enter_and_open() -> None:
        try:
            ns_fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(ns_fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {netns_path}")
            finally:
                os.close(ns_fd)
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
            try:
                ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
            except OSError:
                os.close(fd)
                raise
            result["fd"] = fd
        except OSError as e:
            result["error"] = e

    t = threading.Thread(target=enter_and_open, name="open-tap")
    t.start()
    t.join()
    if "error" in result:
        e = result["error"]
        raise net_error("network.setup_failed", f"cannot open {name} in {netns_path}: {e}")
    fd = int(result["fd"])
    os.set_inheritable(fd, False)
    return fd
