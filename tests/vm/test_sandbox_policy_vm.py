"""Network and filesystem policy with real MicroVMs, through CubeMaster → Cubelet → shim → guest (workload exec).

Two sandboxes (two boots): `closed` has the default policy (no NIC, no scratch disk, no share); `tool` has an
egress allowlist of one address and port, a 64 MiB scratch disk and one allowlisted host directory shown
read-only. The uplink of the sandbox networks is a namespace this test makes (`cbt-<run>`), routing to a peer
namespace with two addresses and a server on two ports (tests/support/peer_net.py); no route leads further, so
nothing the guest sends can leave. Everything is removed in teardown, by name and by pid.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.images.manifest import Manifest
from cubeaccel.wire.master_api import Sandbox
from tests.support.master_harness import MasterProcess, emulated_cubelet
from tests.support.peer_net import ALLOWED, OTHER, OTHER_PORT, PORT, PROBE, UPLINK_LINK, peer_net, sh
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.test_master_ready import edu_template

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]  # two cold boots under TCG on a shared host
SCRATCH_MIB = 64


@pytest.fixture(scope="module")
def uplink() -> Iterator[str]:
    with peer_net() as net:
        yield net.uplink


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, guest_image: Manifest, uplink: str) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("policy")
    master = MasterProcess(base / "master").start()
    (base / "cubelet").mkdir()
    # The one host directory the operator allowlists, shown read-only in `tool`. The VMM's own uid opens it, so it
    # lives where that uid can reach it (pytest's base dir is root-only 0700), and is removed with the stack.
    shared = Path(tempfile.mkdtemp(prefix="cubeaccel-models-", dir="/tmp"))
    shared.chmod(0o755)
    (shared / "weights.txt").write_text("read-only weights\n")
    (shared / "weights.txt").chmod(0o644)  # whatever this process's umask: the guest reads it through the VMM's uid
    cubelet = emulated_cubelet(
        master, base / "cubelet", "policy-node", "--network-uplink-netns", uplink, "--allow-readonly-mount", str(shared)
    )
    cubelet.start()
    started: list[str] = []
    try:
        poll(lambda: any(n.node == "policy-node" and n.state == "ready" for n in master.client.nodes()), 30)
        closed = edu_template(guest_image, "edu-closed")
        tool = edu_template(guest_image, "edu-tool")
        tool["spec"]["sandbox"] = {
            "network": {"mode": "allowlist", "egress": [f"{ALLOWED}/32:{PORT}", f"{OTHER}/32:{PORT}"]},
            "filesystem": {
                "scratch_mib": SCRATCH_MIB,
                "readonly_mounts": [{"source": str(shared), "target": "/models"}],
            },
        }
        master.client.register_template(closed)
        master.client.register_template(tool)
        acc = [{"class": "accelerator"}]
        sb_closed = master.client.create({"template": "edu-closed", "accelerators": acc})
        started.append(sb_closed.id)
        # the request narrows the template's two destinations to one
        narrowed = {"mode": "allowlist", "egress": [f"{ALLOWED}/32:{PORT}"]}
        sb_tool = master.client.create({"template": "edu-tool", "accelerators": acc, "network": narrowed})
        started.append(sb_tool.id)

        def running(sid: str) -> bool:
            return _running(master.client.sandbox(sid))

        for sb in (sb_closed, sb_tool):
            poll(functools.partial(running, sb.id), 240, what=f"{sb.id} running")
        yield {
            "master": master,
            "cubelet": cubelet,
            "base": base,
            "shared": shared,
            "uplink": uplink,
            "closed": sb_closed,
            "tool": sb_tool,
        }
    finally:
        cubelet.stop()
        master.stop()
        kill_started_vmms(base)
        shutil.rmtree(shared, ignore_errors=True)
        for sid in started:  # a failed run leaves no namespace behind (only this run's sandboxes, by name)
            subprocess.run(["ip", "netns", "del", f"cube-{sid}"], check=False, capture_output=True, timeout=30)


def _running(row: Sandbox) -> bool:
    """Running yet; a start that ended fails at once, with its error (not after the whole deadline)."""
    assert row.state not in ("failed", "deleted", "lost"), (row.state, row.error)
    return row.state == "running"


def run(stack: dict[str, Any], which: str, *argv: str, user: str | None = None) -> subprocess.CompletedProcess[bytes]:
    sb = stack[which]
    env = {
        **os.environ,
        "CUBEACCEL_MASTER": stack["master"].url,
        "CUBEACCEL_API_KEY": stack["master"].admin_key,
        "CUBEACCEL_SANDBOX_TOKEN": sb.access_token,
    }
    # --no-stdin: nothing to send, and no stdin reader left running at the CLI's exit
    cmd = [sys.executable, "-c", "from cubeaccel.cli import main; main()", "sandbox", "exec", "--no-stdin"]
    cmd += ["--user", user] if user else []
    return subprocess.run(
        [*cmd, sb.id, "--", *argv], capture_output=True, env=env, timeout=180, stdin=subprocess.DEVNULL
    )


def probe(stack: dict[str, Any], which: str, *targets: str) -> dict[str, str]:
    r = run(stack, which, "python3", "-c", PROBE, *targets)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def test_a_closed_sandbox_has_no_network_interface_but_lo(stack: dict[str, Any]) -> None:
    r = run(stack, "closed", "ls", "/sys/class/net")
    assert r.returncode == 0 and r.stdout.split() == [b"lo"], r.stderr
    assert probe(stack, "closed", f"{ALLOWED}:{PORT}") == {f"{ALLOWED}:{PORT}": "OSError"}  # ENETUNREACH
    res = stack["cubelet"].client.reservation(stack["closed"].id).reservation
    assert res.facts.network is None and res.params.network is None


def test_the_allowlisted_guest_reaches_only_the_allowed_address_and_port(stack: dict[str, Any]) -> None:
    r = run(stack, "tool", "ls", "/sys/class/net")
    assert r.stdout.split() == [b"eth0", b"lo"], r.stderr
    got = probe(stack, "tool", f"{ALLOWED}:{PORT}", f"{ALLOWED}:{OTHER_PORT}", f"{OTHER}:{PORT}", "169.254.169.254:80")
    assert got[f"{ALLOWED}:{PORT}"].startswith(f"hello {PORT} from {ALLOWED}")
    assert got[f"{ALLOWED}:{OTHER_PORT}"] == "ConnectionRefusedError"  # the server listens there: policy refused
    assert got[f"{OTHER}:{PORT}"] == "ConnectionRefusedError"  # in the template's list, narrowed away by the request
    assert got["169.254.169.254:80"] == "ConnectionRefusedError"  # metadata
    # the host end of the sandbox link drops everything (the namespace accepts nothing from the guest), and the
    # uplink end of the veth is one of the node's own addresses, never a destination
    facts = stack["cubelet"].client.reservation(stack["tool"].id).reservation.facts.network
    peer = facts["veth_cidr"].split("/")[0].rsplit(".", 1)
    uplink_end = f"{peer[0]}.{int(peer[1]) + 1}"
    got = probe(stack, "tool", f"{facts['gateway']}:22", f"{uplink_end}:{PORT}")
    assert got == {f"{facts['gateway']}:22": "TimeoutError", f"{uplink_end}:{PORT}": "ConnectionRefusedError"}
    # and both servers really are up: from the uplink namespace itself, the other port and address answer
    for addr, port in ((ALLOWED, OTHER_PORT), (OTHER, PORT)):
        one = "import socket,sys; print(socket.create_connection((sys.argv[1], int(sys.argv[2])), 5).recv(99))"
        out = sh("ip", "netns", "exec", stack["uplink"], sys.executable, "-c", one, addr, str(port))
        assert f"hello {port}" in out


def test_the_policy_is_recorded_shown_and_audited(stack: dict[str, Any]) -> None:
    sid = stack["tool"].id
    res = stack["cubelet"].client.reservation(sid).reservation
    assert res.params.network is not None
    assert (res.params.network.mode, res.params.network.egress) == ("allowlist", [f"{ALLOWED}/32:{PORT}/tcp"])
    assert res.facts.network["netns"] == f"cube-{sid}"
    shown = stack["master"].client.sandbox(sid)
    assert shown.request.network_policy == res.params.network.model_dump(mode="json")
    audit = [json.loads(x) for x in (stack["base"] / "cubelet" / "audit.jsonl").read_text().splitlines()]
    applied = [e for e in audit if e.get("action") == "network:apply" and e.get("target") == sid]
    assert applied and applied[0]["egress"] == [f"{ALLOWED}/32:{PORT}/tcp"]


def test_a_request_cannot_widen_the_template_network(stack: dict[str, Any]) -> None:
    from cubeaccel.protocol.errors import CubeError

    wider = {"mode": "allowlist", "egress": [f"{ALLOWED}/32:{OTHER_PORT}"]}
    with pytest.raises(CubeError) as e:
        stack["master"].client.create(
            {"template": "edu-tool", "accelerators": [{"class": "accelerator"}], "network": wider}
        )
    assert e.value.code == "network.policy_widened"


def test_only_the_allowlisted_host_directory_is_shared_and_only_for_reading(stack: dict[str, Any]) -> None:
    r = run(stack, "tool", "cat", "/models/weights.txt")
    assert r.returncode == 0 and r.stdout == b"read-only weights\n", r.stderr
    for user in (None, "root"):  # not even the guest's root can write through it
        r = run(stack, "tool", "sh", "-c", "echo x > /models/new", user=user)
        assert r.returncode != 0 and b"Read-only file system" in r.stderr, r.stderr
    assert sorted(p.name for p in stack["shared"].iterdir()) == ["weights.txt"]
    r = run(stack, "closed", "sh", "-c", "cat /proc/mounts; ls /models")
    assert b" 9p " not in r.stdout and r.returncode != 0  # the closed sandbox shares nothing


def test_filling_the_scratch_space_gives_enospc_in_the_guest_and_leaves_the_host_alone(stack: dict[str, Any]) -> None:
    sid = stack["tool"].id
    disk = stack["base"] / "cubelet" / "shims" / sid / "scratch.img"
    assert disk.stat().st_size == SCRATCH_MIB * 1024 * 1024
    fill = (
        "import errno\n"
        "n = 0\n"
        "try:\n"
        "    with open('/tmp/fill', 'wb') as f:\n"
        "        while True:\n"
        "            f.write(b'x' * (1 << 20)); n += 1\n"
        "            if n > 4096: raise SystemExit('no limit')\n"
        "except OSError as e:\n"
        "    print(errno.errorcode[e.errno], n)\n"
    )
    r = run(stack, "tool", "python3", "-c", fill)  # as the workload's default user
    assert r.returncode == 0, r.stderr
    code, mib = r.stdout.split()
    assert code == b"ENOSPC" and SCRATCH_MIB // 2 < int(mib) <= SCRATCH_MIB, r.stdout
    r = run(stack, "tool", "sh", "-c", "echo more > /home/user/x")
    assert r.returncode != 0 and b"No space left" in r.stderr
    # the host paid at most the cap for it: the file neither grew nor allocated more than its size (the limit is
    # the disk's, not the host filesystem's free space, which other runs on this host change meanwhile)
    st = disk.stat()
    assert st.st_size == SCRATCH_MIB * 1024 * 1024 and st.st_blocks * 512 <= st.st_size


def test_nothing_remains_after_delete(stack: dict[str, Any]) -> None:
    master, cubelet, sid = stack["master"], stack["cubelet"], stack["tool"].id
    facts = cubelet.client.reservation(sid).reservation.facts.network

    def uplink_links() -> set[str]:
        return {x["ifname"] for x in json.loads(sh("ip", "-n", stack["uplink"], "-j", "link", "show"))}

    assert facts["uplink_if"] in uplink_links()
    master.client.delete(sid)
    master.client.delete(stack["closed"].id)
    poll(lambda: master.client.sandbox(sid).state == "deleted", 120)
    poll(lambda: not Path(f"/run/netns/cube-{sid}").exists(), 60)
    assert not (stack["base"] / "cubelet" / "shims" / sid / "scratch.img").exists()
    # the kernel frees a namespace (and the veth pair with it) shortly after its last user is gone
    poll(lambda: uplink_links() <= {"lo", UPLINK_LINK}, 30, what=f"only the test's own links: {uplink_links()}")
    kinds = [e.kind for e in cubelet.client.events().events if e.sandbox_id == sid]
    assert "network_applied" in kinds and "network_removed" in kinds
