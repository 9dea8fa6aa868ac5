"""The whole path with a real MicroVM: CubeMaster → Cubelet (its proxy) → the shim's bridge → the guest's
cube-workload, driven by the CLI (`cubeaccel sandbox exec/cp`) as a user drives it. One sandbox for the module."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cubeaccel.images.manifest import Manifest
from tests.support.master_harness import MasterProcess, emulated_cubelet
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.test_master_ready import edu_template

pytestmark = pytest.mark.vm
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory, guest_image: Manifest) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("path")
    master = MasterProcess(base / "master").start()
    (base / "cubelet").mkdir()
    cubelet = emulated_cubelet(master, base / "cubelet", "wl-node")
    cubelet.start()
    try:
        poll(lambda: any(n.node == "wl-node" and n.state == "ready" for n in master.client.nodes()), 30)
        master.client.register_template(edu_template(guest_image, "edu-wl"))
        sb = master.client.create({"template": "edu-wl", "accelerators": [{"class": "accelerator"}]})
        poll(lambda: master.client.sandbox(sb.id).state == "running", 180)
        yield {"master": master, "cubelet": cubelet, "id": sb.id, "token": sb.access_token, "base": base}
    finally:
        cubelet.stop()
        master.stop()
        kill_started_vmms(base)


def cli(sb: dict[str, Any], *args: str, stdin: bytes | None = None, token: str | None = None) -> Any:
    env = {
        **os.environ,
        "CUBEACCEL_MASTER": sb["master"].url,
        "CUBEACCEL_API_KEY": sb["master"].admin_key,
        "CUBEACCEL_SANDBOX_TOKEN": token or sb["token"],
    }
    return subprocess.run(
        [sys.executable, "-c", "from cubeaccel.cli import main; main()", "sandbox", *args],
        input=stdin if stdin is not None else b"",
        capture_output=True,
        env=env,
        timeout=120,
    )


def test_the_token_is_given_once_and_stored_only_hashed(sandbox: dict[str, Any]) -> None:
    token = sandbox["token"]
    assert isinstance(token, str) and len(token) >= 32
    assert sandbox["master"].client.sandbox(sandbox["id"]).access_token is None  # not kept by CubeMaster
    res = sandbox["cubelet"].client.reservation(sandbox["id"])
    assert res.access_token is None
    facts = res.reservation.facts
    assert facts.workload_token_sha256 == hashlib.sha256(token.encode()).hexdigest()
    for path in sandbox["base"].rglob("*"):  # not in any file: spec, database, logs, events
        if path.is_file() and path.stat().st_size < 64 * MiB and not path.is_socket():
            assert token.encode() not in path.read_bytes(), path


def test_exec_streams_output_and_exits_with_the_commands_code(sandbox: dict[str, Any]) -> None:
    r = cli(sandbox, "exec", sandbox["id"], "--", "/bin/bash", "-c", "echo out; echo err >&2; exit 7")
    assert (r.returncode, r.stdout, r.stderr) == (7, b"out\n", b"err\n"), r.stdout.decode()
    r = cli(
        sandbox,
        "exec",
        "--env",
        "A=b c",
        "--cwd",
        "/tmp",
        "--user",
        "root",
        sandbox["id"],
        "--",
        "sh",
        "-c",
        'echo "$A"; pwd; id -u',
    )
    assert r.returncode == 0 and r.stdout == b"b c\n/tmp\n0\n", r.stderr
    r = cli(sandbox, "exec", sandbox["id"], "--", "tr", "a-z", "A-Z", stdin=b"from stdin\n")
    assert r.returncode == 0 and r.stdout == b"FROM STDIN\n", r.stderr
    t0 = time.monotonic()
    r = cli(sandbox, "exec", "--timeout", "1", sandbox["id"], "--", "sleep", "100")
    # past its timeout the command is killed and the stream ends as envd's: a deadline error (issue 29), said
    # so, and the CLI exits 124 as timeout(1) does
    assert r.returncode == 124 and b"deadline_exceeded" in r.stderr and time.monotonic() - t0 < 30, r.stderr


def test_cp_round_trips_a_binary_file(sandbox: dict[str, Any], tmp_path: Path) -> None:
    blob = os.urandom(5 * MiB)
    (tmp_path / "in.bin").write_bytes(blob)
    r = cli(sandbox, "cp", str(tmp_path / "in.bin"), f"{sandbox['id']}:/tmp/cp/in.bin")
    assert r.returncode == 0, r.stderr
    r = cli(sandbox, "cp", f"{sandbox['id']}:/tmp/cp/in.bin", str(tmp_path / "out.bin"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.bin").read_bytes() == blob
    # a body with a Content-Length above the API's 1 MiB limit passes the proxy (it streams), as the SDK sends it
    url = next(n.cubelet_url for n in sandbox["master"].client.nodes() if n.node == "wl-node")
    r = httpx.post(
        f"{url}/v1/sandboxes/{sandbox['id']}/workload/files",
        params={"path": "/tmp/cp/sized.bin"},
        content=blob[: 2 * MiB],
        headers={"X-Access-Token": sandbox["token"], "Content-Type": "application/octet-stream"},
        timeout=120,
    )
    assert r.status_code == 200, r.text


def test_the_proxy_refuses_a_missing_or_wrong_token(sandbox: dict[str, Any]) -> None:
    r = cli(sandbox, "exec", sandbox["id"], "--", "true", token="wrong-token-" + "x" * 30)
    assert r.returncode == 1 and b"workload.unauthenticated" in r.stdout + r.stderr
    url = next(n.cubelet_url for n in sandbox["master"].client.nodes() if n.node == "wl-node")
    base = f"{url}/v1/sandboxes/{sandbox['id']}/workload"
    assert httpx.post(f"{base}/process.Process/List", json={}).status_code == 401
    assert httpx.get(f"{base}/health").status_code == 204  # open, as envd's


def test_delete_releases_the_device_after_workloads(sandbox: dict[str, Any]) -> None:
    master, cubelet = sandbox["master"], sandbox["cubelet"]
    dev = master.client.sandbox(sandbox["id"]).device_ids[0]
    master.client.delete(sandbox["id"])
    poll(lambda: master.client.sandbox(sandbox["id"]).state == "deleted", 90)
    poll(lambda: next(d for d in cubelet.client.devices() if d.id == dev).state == "allocatable", 60)
    r = cli(sandbox, "exec", sandbox["id"], "--", "true")
    assert r.returncode == 1
