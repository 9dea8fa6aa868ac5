"""What warm-claim tests read off real processes: the Cubelet's claimed warm ids, a request sitting unread in a
stopped server's socket."""

from __future__ import annotations

from pathlib import Path

from tests.support.cubelet_process import CubeletProcess


def claimed_warm_ids(node: CubeletProcess) -> list[str]:
    """The warm ids the Cubelet handed out: each claimed reservation keeps its warm sandbox's shim id."""
    out = []
    for r in node.client.request("GET", "/v1/reservations")["reservations"]:
        shim = (r.get("facts") or {}).get("shim_id")
        if shim and shim.startswith("warm-") and not r["sandbox_id"].startswith("warm-"):
            out.append(shim)
    return out


def request_waiting_on(port: int) -> bool:
    """A connection to 127.0.0.1:`port` holds bytes its (stopped) server has not read: a request was sent."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        local, state, queues = f[1], f[3], f[4]
        if state == "01" and int(local.split(":")[1], 16) == port and int(queues.split(":")[1], 16) > 0:
            return True
    return False
