"""Namespaces a sandbox network test builds around the node: an uplink namespace that plays the node (it routes)
and a peer namespace beyond it holding the servers a guest may be allowed to reach. Documentation and benchmark
addresses only (192.0.2.0/24, 198.18.0.0/30), and no default route out of the uplink: nothing leaves.

The servers live in the peer, not in the uplink: the node's own addresses are never a destination
(host/net/netpolicy.py), so a server on one of them could not be reached whatever the allowlist says."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ALLOWED, OTHER = "192.0.2.10", "192.0.2.20"
PORT, OTHER_PORT = 8080, 8081
UPLINK_PEER_ADDR, PEER_ADDR = "198.18.0.1", "198.18.0.2"
UPLINK_LINK, PEER_LINK = "pu0", "pp0"
SERVER = f"""
import socket, threading
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", port)); s.listen()
    while True:
        c, a = s.accept(); c.sendall(f"hello {{port}} from {{c.getsockname()[0]}}\\n".encode()); c.close()
for p in ({PORT}, {OTHER_PORT}):
    threading.Thread(target=serve, args=(p,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""
# Run in the guest as the workload: connect to each target, print what happened.
PROBE = """
import socket, sys, json
out = {}
for target in sys.argv[1:]:
    host, port = target.split(":")
    try:
        s = socket.create_connection((host, int(port)), timeout=5)
        out[target] = s.recv(100).decode().strip()
        s.close()
    except OSError as e:
        out[target] = type(e).__name__
print(json.dumps(out))
"""


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=30).stdout


@dataclass(frozen=True)
class PeerNet:
    uplink: str  # the namespace Cubelet's `--network-uplink-netns` names
    peer: str


@contextmanager
def peer_net() -> Iterator[PeerNet]:
    if shutil.which("nft") is None or shutil.which("ip") is None:
        raise RuntimeError("ip and nft are needed (scripts/install-system-deps.sh installs nftables)")
    run = uuid.uuid4().hex[:8]
    uplink, peer = f"cbt-{run}", f"cbp-{run}"
    server = None
    try:
        for ns in (uplink, peer):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", uplink, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        sh("ip", "-n", uplink, "link", "add", UPLINK_LINK, "type", "veth", "peer", "name", PEER_LINK, "netns", peer)
        sh("ip", "-n", uplink, "addr", "add", f"{UPLINK_PEER_ADDR}/30", "dev", UPLINK_LINK)
        sh("ip", "-n", peer, "addr", "add", f"{PEER_ADDR}/30", "dev", PEER_LINK)
        for addr in (ALLOWED, OTHER):
            sh("ip", "-n", peer, "addr", "add", f"{addr}/32", "dev", PEER_LINK)
        sh("ip", "-n", uplink, "link", "set", UPLINK_LINK, "up")
        sh("ip", "-n", peer, "link", "set", PEER_LINK, "up")
        sh("ip", "-n", uplink, "route", "add", "192.0.2.0/24", "via", PEER_ADDR)
        sh("ip", "-n", peer, "route", "add", "default", "via", UPLINK_PEER_ADDR)
        assert "default" not in sh("ip", "-n", uplink, "route", "show")  # nothing leaves the uplink
        server = subprocess.Popen(
            ["ip", "netns", "exec", peer, sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True
        )
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield PeerNet(uplink, peer)
    finally:
        if server is not None:
            server.kill()
            server.wait(10)
        for ns in (peer, uplink):
            subprocess.run(["ip", "netns", "del", ns], check=False, timeout=30)
