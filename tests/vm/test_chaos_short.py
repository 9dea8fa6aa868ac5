"""A short chaos run (issue 30): create, exec, then a kill — the VMM, the shim, or the Cubelet together with the
VMM — in a loop on an emulated Cubelet (real shims, real confined QEMU, real networks); afterwards nothing of it is
left: no QEMU or shim, no namespace (its TAP and nftables tables live in it), no uplink veth, no locked memory in
the ledger, no live run directory, and every device allocatable. Only what this test started is killed or
inspected: processes by the pids its Cubelet reports, networks by its sandboxes' names, in its own uplink namespace.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.host.net.netpolicy import netns_name, uplink_ifname
from cubeaccel.images.manifest import Manifest
from cubeaccel.model.contract import freeze
from cubeaccel.transport.workload_client import WorkloadClient
from cubeaccel.wire.templates import parse_template
from tests.support.cubelet_process import CubeletProcess
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms, started_vmms
from tests.vm.test_master_ready import edu_template

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1200)]
NODE = "chaos-node"
KILLS = ("vmm", "shim", "cubelet_with_vmm")


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=30).stdout


@pytest.fixture
def uplink() -> Iterator[str]:
    if shutil.which("nft") is None or shutil.which("ip") is None:
        pytest.fail("ip and nft are needed (scripts/install-system-deps.sh installs nftables)")
    ns = f"cbc-{uuid.uuid4().hex[:8]}"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, timeout=30)


@pytest.fixture
def node(tmp_path: Path, guest_image: Manifest, uplink: str) -> Iterator[CubeletProcess]:
    (tmp_path / "node").mkdir()
    p = CubeletProcess(
        tmp_path / "node",
        "-",
        "--backend",
        "emulated",
        "--node",
        NODE,
        "--release-timeout",
        "20",
        "--scrub",
        "accelerator=none",  # one boot fewer per cycle: the scrub VM has its own tests
        "--network-uplink-netns",
        uplink,
    ).start()
    try:
        yield p
    finally:
        p.stop()
        kill_started_vmms(tmp_path)


def networked_contract(image: Manifest) -> dict[str, Any]:
    """edu-demo with a NIC (allowlist egress): each sandbox gets a namespace, a TAP, rules and an uplink veth."""
    doc = edu_template(image, "edu-chaos")
    doc["spec"]["sandbox"] = {"network": {"mode": "allowlist", "egress": ["192.0.2.10/32:8080"]}}
    return freeze(parse_template(doc, "edu-chaos")).to_json()


def _seen(p: CubeletProcess, sid: str, kind: str) -> bool:
    return any(e.sandbox_id == sid and e.kind == kind for e in p.client.events(0, 10000).events)


def _kill(p: CubeletProcess, sid: str, what: str) -> None:
    if what == "shim":
        pid = p.shim(sid)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        return
    vmm = p.vmm(sid)
    assert vmm is not None
    if what == "cubelet_with_vmm":
        p.sigkill()
    os.kill(vmm, signal.SIGKILL)
    if what == "cubelet_with_vmm":
        poll(lambda: p.vmm(sid) is None, 30, what="the VMM gone")
        p.start()


def _leaks(p: CubeletProcess, root: Path, sids: list[str], uplink: str) -> dict[str, Any]:
    links = sh("ip", "-n", uplink, "-o", "link", "show")
    tables = sh("ip", "netns", "exec", uplink, "nft", "list", "tables")
    pinned = p.client.request("GET", "/v1/host")["pinned_memory"]
    found = {
        "vmms": started_vmms(root),
        "processes": {s: (p.vmm(s), p.shim(s)) for s in sids if p.vmm(s) or p.shim(s)},
        "netns": [s for s in sids if Path("/run/netns", netns_name(s)).exists()],
        "uplink_veths": [s for s in sids if uplink_ifname(s, NODE) in links],
        "uplink_tables": tables.split(),
        "locked_mib": pinned["locked_mib"],
        "run_dirs": [s for s in sids if (p.state_dir / "shims" / s).exists()],
        "devices": [d.state for d in p.client.devices() if d.state != "allocatable"],
    }
    return {k: v for k, v in found.items() if v}


def test_kills_in_a_create_exec_loop_leave_nothing_behind(
    node: CubeletProcess, guest_image: Manifest, uplink: str, tmp_path: Path
) -> None:
    contract = networked_contract(guest_image)
    sids = []
    for i, what in enumerate(KILLS):
        sid = f"chaos-{os.getpid()}-{i}"
        sids.append(sid)
        token = secrets.token_urlsafe(24)
        node.client.reserve(sid, 1, contract=contract, start=True, workload_token=token)
        poll(functools.partial(_seen, node, sid, "guest_checked"), 240, what=f"{sid} validated")
        # While it runs, the leak check sees every kind of thing it looks for (else it could never fail).
        live = _leaks(node, tmp_path, [sid], uplink)
        assert {"vmms", "processes", "netns", "uplink_veths", "locked_mib", "run_dirs", "devices"} <= live.keys()
        sock = node.state_dir / "shims" / sid / "workload.sock"
        wl = WorkloadClient.over("http://workload", token, uds=str(sock))
        try:
            assert wl.exec(["/bin/true"]).exit_code == 0
        finally:
            wl.close()
        _kill(node, sid, what)
        poll(functools.partial(_seen, node, sid, "reservation_closed"), 180, what=f"{sid} closed after a {what} kill")

    def clean() -> bool:
        found = _leaks(node, tmp_path, sids, uplink)
        if found:
            raise LookupError(found)  # poll names the last one if it never clears
        return True

    poll(clean, 60, what="nothing left")
