"""The tenant CLI (issue 30 #9): `cubeaccel sandbox exec` and `cp` with a tenant key, as subprocesses, against
CubeMaster, a Cubelet and a real MicroVM. The workload endpoint comes from the tenant's own route; the command's
exit code is the CLI's, also while the CLI's stdin stays open."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cubeaccel.images.manifest import Manifest
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.master_client import MasterClient
from tests.support.master_harness import MasterProcess, emulated_cubelet
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.test_master_ready import edu_template

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]
NODE = "tenant-cli-node"
TEMPLATE = "edu-tenant-cli"
CLI = [sys.executable, "-c", "from cubeaccel.cli import main; main()"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, guest_image: Manifest) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("tenantcli")
    master = MasterProcess(base / "master").start()
    (base / "cubelet").mkdir()
    cubelet = emulated_cubelet(master, base / "cubelet", NODE)
    cubelet.start()
    tenant = MasterClient(master.url, key=master.tenant_key)
    try:
        poll(lambda: any(n.node == NODE and n.state == "ready" for n in master.client.nodes()), 30)
        master.client.register_template(edu_template(guest_image, TEMPLATE))
        other_key = master.client.request("POST", "/v1/tenants", {"name": f"other{os.getpid()}"})["key"]
        sb = tenant.create({"template": TEMPLATE, "accelerators": [{"class": "accelerator"}]})
        poll(lambda: tenant.sandbox(sb.id).state == "running", 240)
        yield {"master": master, "sb": sb, "other_key": other_key, "base": base}
    finally:
        tenant.close()
        cubelet.stop()
        master.stop()
        kill_started_vmms(base)


def env(stack: dict[str, Any], key: str | None = None) -> dict[str, str]:
    return {
        **os.environ,
        "CUBEACCEL_MASTER": stack["master"].url,
        "CUBEACCEL_API_KEY": key or stack["master"].tenant_key,
        "CUBEACCEL_SANDBOX_TOKEN": stack["sb"].access_token,
    }


def test_tenant_exec_passes_stdin_and_returns_the_commands_exit_code(stack: dict[str, Any]) -> None:
    sid = stack["sb"].id
    r = subprocess.run(
        [*CLI, "sandbox", "exec", sid, "--", "sh", "-c", "cat; echo err >&2; exit 3"],
        input=b"from stdin\n",
        capture_output=True,
        env=env(stack),
        timeout=180,
    )
    assert (r.returncode, r.stdout, r.stderr) == (3, b"from stdin\n", b"err\n"), r.stderr


def test_exit_code_survives_a_stdin_that_stays_open(stack: dict[str, Any]) -> None:
    """The command ends while the CLI's stdin (a pipe this test holds open) is still being read."""
    sid = stack["sb"].id
    p = subprocess.Popen(
        [*CLI, "sandbox", "exec", sid, "--", "sh", "-c", "echo done; exit 7"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(stack),
    )
    assert p.stdin is not None and p.stdout is not None and p.stderr is not None
    try:
        rc = p.wait(180)  # stdin still open: nothing was written, nothing closed
        out, err = p.stdout.read(), p.stderr.read()
    finally:
        p.stdin.close()
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert (rc, out) == (7, b"done\n"), err


def test_a_tenant_key_alone_is_enough_for_exec(stack: dict[str, Any]) -> None:
    """No token given: the CLI obtains the sandbox's access token with the tenant's key (connect)."""
    sid = stack["sb"].id
    bare = {k: v for k, v in env(stack).items() if k != "CUBEACCEL_SANDBOX_TOKEN"}
    r = subprocess.run(
        [*CLI, "sandbox", "exec", sid, "--no-stdin", "--", "sh", "-c", "echo via-key"],
        capture_output=True,
        env=bare,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert (r.returncode, r.stdout) == (0, b"via-key\n"), r.stderr


def test_tenant_cp_copies_both_ways(stack: dict[str, Any], tmp_path: Path) -> None:
    sid = stack["sb"].id
    src, back = tmp_path / "in.bin", tmp_path / "back.bin"
    src.write_bytes(os.urandom(300_000))
    for args in ((str(src), f"{sid}:/tmp/tenant/in.bin"), (f"{sid}:/tmp/tenant/in.bin", str(back))):
        r = subprocess.run([*CLI, "sandbox", "cp", *args], capture_output=True, env=env(stack), timeout=180)
        assert r.returncode == 0, r.stderr
    assert back.read_bytes() == src.read_bytes()


def test_another_tenant_learns_nothing_and_node_routes_stay_admin_only(stack: dict[str, Any]) -> None:
    sid = stack["sb"].id
    r = subprocess.run(
        [*CLI, "sandbox", "exec", "--no-stdin", sid, "--", "true"],
        capture_output=True,
        env=env(stack, stack["other_key"]),
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode != 0 and b"sandbox.not_found" in r.stdout + r.stderr, r.stdout + r.stderr
    tenant = MasterClient(stack["master"].url, key=stack["master"].tenant_key)
    try:
        assert tenant.workload_endpoint(sid).url.endswith(f"/v1/sandboxes/{sid}/workload")
        with pytest.raises(CubeError) as e:
            tenant.nodes()
        assert e.value.code == "auth.forbidden"
    finally:
        tenant.close()
