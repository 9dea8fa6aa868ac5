"""The real e2b SDK against `cubeaccel api serve` in front of CubeMaster, a Cubelet and a real MicroVM with a
hot-plugged (emulated) device. One sandbox serves the whole module (boots are slow under TCG); the last test
kills it. The https/HTTP-2 way (E2B_DOMAIN) and the 2.15 SDK line are in test_e2b_domain.py."""

from __future__ import annotations

import datetime
import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import CommandExitException, Sandbox, SandboxQuery
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import (
    AuthenticationException,
    FileNotFoundException,
    NotFoundException,
    SandboxException,
    SandboxNotRunningException,
)
from packaging.version import Version

from cubeaccel.images.manifest import Manifest
from cubeaccel.transport.workload_client import WorkloadClient
from cubeaccel.workload import ENVD_VERSION
from tests.support.e2b_sdk import run_check, sdk_path
from tests.support.frontdoor_process import ConnectProxy, FrontDoorProcess, tls_files
from tests.support.master_harness import MasterProcess, emulated_cubelet
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.test_master_ready import edu_template

pytestmark = pytest.mark.vm
NODE = "e2b-node"
TEMPLATE = "edu-e2b"
DOMAIN = "e2b.test"
MiB = 1024 * 1024


def start_stack(base: Any, guest_image: Manifest, *fd_args: str) -> dict[str, Any]:
    master = MasterProcess(base / "master").start()
    (base / "cubelet").mkdir()
    cubelet = emulated_cubelet(master, base / "cubelet", NODE)
    cubelet.start()
    poll(lambda: any(n.node == NODE and n.state == "ready" for n in master.client.nodes()), 30)
    master.client.register_template(edu_template(guest_image, TEMPLATE))
    fd = FrontDoorProcess(base / "fd", master.url, master.admin_key, "--domain", DOMAIN, *fd_args).start()
    return {"master": master, "cubelet": cubelet, "fd": fd, "base": base}


def stop_stack(s: dict[str, Any]) -> None:
    s["fd"].stop()
    s["cubelet"].stop()
    s["master"].stop()
    kill_started_vmms(s["base"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, guest_image: Manifest) -> Iterator[dict[str, Any]]:
    s = start_stack(tmp_path_factory.mktemp("e2b"), guest_image)
    s["key"] = s["master"].tenant_key
    s["tag"] = f"vm{time.monotonic_ns()}"
    try:
        yield s
    finally:
        stop_stack(s)


def opts(stack: dict[str, Any], **kw: Any) -> dict[str, Any]:
    url = stack["fd"].url
    return {"api_key": stack["key"], "api_url": url, "sandbox_url": url, "request_timeout": 300, **kw}


@pytest.fixture(scope="module")
def sbx(stack: dict[str, Any]) -> Iterator[Sandbox]:
    t0 = time.monotonic()
    s = Sandbox.create(
        TEMPLATE, envs={"FROM_CREATE": "yes", "SHADOWED": "sandbox"}, metadata={"suite": stack["tag"]}, **opts(stack)
    )
    stack["create_s"] = time.monotonic() - t0
    try:
        yield s
    finally:
        if stack["master"].client.sandbox(s.sandbox_id).state == "running":
            stack["master"].client.delete(s.sandbox_id)


def test_create_returns_a_running_sandbox_with_its_device(stack: dict[str, Any], sbx: Sandbox) -> None:
    row = stack["master"].client.sandbox(sbx.sandbox_id)
    assert row.state == "running" and row.node == NODE and len(row.device_ids) == 1
    assert row.template.name == TEMPLATE
    r = sbx.commands.run("cat /sys/bus/pci/devices/*/vendor /sys/bus/pci/devices/*/device")
    assert "0x1234" in r.stdout and "0x11e8" in r.stdout, r.stdout  # the hot-plugged edu device
    assert sbx.is_running()


def test_metrics_are_the_guests_samples_and_the_newest_names_its_device(stack: dict[str, Any], sbx: Sandbox) -> None:
    metrics = sbx.get_metrics()
    assert metrics, "the guest samples from its start"
    m = metrics[-1]
    assert m.cpu_count >= 1 and 0 < m.mem_used <= m.mem_total and 0 <= m.disk_used <= m.disk_total
    assert m.timestamp.tzinfo is not None
    raw = httpx.get(
        f"{stack['fd'].url}/sandboxes/{sbx.sandbox_id}/metrics", headers={"X-API-Key": stack["key"]}, timeout=60
    ).json()
    (device,) = raw[-1]["devices"]
    assert device["id"] == stack["master"].client.sandbox(sbx.sandbox_id).device_ids[0]
    assert device["state"] not in ("allocatable", "quarantined")
    assert [(g["vendor"], g["device"]) for g in device["guest"]] == [("0x1234", "0x11e8")]  # the edu device
    assert (
        sbx.get_metrics(start=m.timestamp - datetime.timedelta(hours=2), end=m.timestamp - datetime.timedelta(hours=1))
        == []
    )


def test_run_stdout_stderr_exit_codes_env_and_cwd(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo hi; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "err\n", 0)
    r = sbx.commands.run('echo "$FROM_CREATE $SHADOWED $A"; pwd', envs={"A": "b", "SHADOWED": "mine"}, cwd="/tmp")
    assert r.stdout == "yes mine b\n/tmp\n"  # create's envVars reach every command; the command's own win
    assert sbx.commands.run("echo $FROM_CREATE", background=True).wait().stdout == "yes\n"
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo bad >&2; exit 4")
    assert (e.value.exit_code, e.value.stderr) == (4, "bad\n")


def test_output_streams_as_it_is_written(sbx: Sandbox) -> None:
    """Nothing on the way buffers a response: the first line arrives while the command still runs."""
    seen: list[float] = []
    t0 = time.monotonic()
    r = sbx.commands.run("echo one; sleep 3; echo two", on_stdout=lambda _: seen.append(time.monotonic() - t0))
    done = time.monotonic() - t0
    assert r.stdout == "one\ntwo\n" and len(seen) == 2
    assert done - seen[0] > 2.0, (seen, done)


def test_background_command_list_and_kill(sbx: Sandbox) -> None:
    h = sbx.commands.run("sleep 300", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert e.value.exit_code == -1
    assert h.pid not in [p.pid for p in sbx.commands.list()]


def test_stdin(sbx: Sandbox) -> None:
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello\n")
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "hello\n"


def test_files_write_read_list_make_dir_rename_remove(sbx: Sandbox) -> None:
    blob = os.urandom(2 * MiB)
    assert sbx.files.write("/tmp/e2b/blob.bin", blob).path == "/tmp/e2b/blob.bin"
    assert sbx.files.read("/tmp/e2b/blob.bin", format="bytes") == blob
    sbx.files.write("/tmp/e2b/a.txt", "alpha")
    assert sbx.files.read("/tmp/e2b/a.txt") == "alpha"
    assert sbx.files.make_dir("/tmp/e2b/d") is True and sbx.files.make_dir("/tmp/e2b/d") is False
    assert sorted(e.name for e in sbx.files.list("/tmp/e2b")) == ["a.txt", "blob.bin", "d"]
    assert sbx.files.rename("/tmp/e2b/a.txt", "/tmp/e2b/d/a.txt").path == "/tmp/e2b/d/a.txt"
    assert sbx.files.read("/tmp/e2b/d/a.txt") == "alpha"
    sbx.files.remove("/tmp/e2b/d")
    assert not sbx.files.exists("/tmp/e2b/d")
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/tmp/e2b/d/a.txt")


def test_signed_file_urls_work_in_plain_http_mode_and_watch_and_metadata(sbx: Sandbox) -> None:
    """The SDK's signed URLs carry no sandbox id (one E2B_SANDBOX_URL for all): the front door finds the sandbox
    whose token made the signature. And the envd 0.6 features in the real guest: watch and file metadata."""
    up = sbx.upload_url("/tmp/signed/up.txt", use_signature_expiration=120)
    assert "E2b-Sandbox-Id" not in up and sbx.sandbox_id not in up
    r = httpx.post(up, files={"file": ("up.txt", b"signed upload")}, timeout=60)  # no headers at all
    assert r.status_code == 200, r.text
    down = sbx.download_url("/tmp/signed/up.txt", use_signature_expiration=120)
    r = httpx.get(down, timeout=60)
    assert (r.status_code, r.content) == (200, b"signed upload"), r.text
    forged = down.replace("signature=v1_", "signature=v1_A")
    assert httpx.get(forged, timeout=60).status_code == 401
    h = sbx.files.watch_dir("/tmp/signed")
    sbx.files.write("/tmp/signed/w.txt", "watched", metadata={"author": "e2b-test"})
    kinds = [(e.type.name, e.name) for e in h.get_new_events()]
    assert ("CREATE", "w.txt") in kinds and ("WRITE", "w.txt") in kinds, kinds
    h.stop()
    info = sbx.files.get_info("/tmp/signed/w.txt")
    assert (info.size, info.owner) == (7, "user"), info
    kept = sbx.commands.run("python3 -c 'import os; print(os.listxattr(\"/tmp/signed/w.txt\"))'", user="root")
    # the guest's root (tmpfs, Linux 6.1) has no user xattrs: the service keeps the metadata as trusted ones
    assert info.metadata == {"author": "e2b-test"}, kept.stdout
    assert "trusted.e2b.author" in kept.stdout or "user.e2b.author" in kept.stdout, kept.stdout


def test_a_users_own_xattr_in_the_home_is_file_metadata(sbx: Sandbox) -> None:
    """The home has user xattrs (an ext4 RAM disk; the tmpfs root has none on Linux 6.1): metadata the SDK writes
    there is envd's `user.e2b.*`, and one the user sets with the syscall (as E2B's suite does with setfattr) reads
    back as metadata."""
    sbx.files.write("meta.txt", "content", metadata={"stage": "sdk"})
    user_set = "import os; os.setxattr('xattr.txt', 'user.e2b.author', b'mish'); print(os.listxattr('meta.txt'))"
    r = sbx.commands.run(f'echo c > xattr.txt && python3 -c "{user_set}"')
    assert r.stdout.strip() == "['user.e2b.stage']", r
    assert sbx.files.get_info("xattr.txt").metadata == {"author": "mish"}
    assert sbx.files.get_info("meta.txt").metadata == {"stage": "sdk"}


def test_envd_by_host_name_and_a_chunked_upload(stack: dict[str, Any], sbx: Sandbox) -> None:
    url = stack["fd"].url
    host = {"Host": f"49983-{sbx.sandbox_id}.{DOMAIN}"}
    token = {"X-Access-Token": sbx._envd_access_token or ""}
    assert httpx.get(f"{url}/health", headers={**host, **token}).status_code == 204  # the guest's, routed by Host
    assert httpx.get(f"{url}/health", headers=host).status_code == 401  # anonymous: no lookup, no answer
    r = httpx.post(f"{url}/process.Process/List", json={}, headers={**host, **token, "Connect-Protocol-Version": "1"})
    assert r.status_code == 200 and isinstance(r.json(), dict), r.text
    parts = [os.urandom(256 * 1024) for _ in range(8)]

    def chunks() -> Iterator[bytes]:
        yield from parts

    r = httpx.post(
        f"{url}/files",
        params={"path": "/tmp/e2b/chunked.bin"},
        content=chunks(),  # no length: Transfer-Encoding: chunked, streamed through to the guest
        headers={**host, **token, "Content-Type": "application/octet-stream"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert sbx.files.read("/tmp/e2b/chunked.bin", format="bytes") == b"".join(parts)
    wrong = {"X-Access-Token": "x" * 43}
    assert httpx.post(f"{url}/process.Process/List", json={}, headers={**host, **wrong}).status_code == 401


def test_a_wrong_access_token_is_an_authentication_error(stack: dict[str, Any], sbx: Sandbox) -> None:
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}  # what the SDK adds itself
    cfg = ConnectionConfig(
        api_key=stack["key"], api_url=stack["fd"].url, sandbox_url=stack["fd"].url, extra_sandbox_headers=headers
    )
    bad = Sandbox(
        sandbox_id=sbx.sandbox_id,
        sandbox_domain=None,
        envd_version=Version(ENVD_VERSION),
        envd_access_token="wrong-" + "x" * 40,
        traffic_access_token=None,
        connection_config=cfg,
    )
    with pytest.raises(AuthenticationException):
        bad.commands.run("echo no")
    with pytest.raises(AuthenticationException):
        bad.files.read("/tmp/e2b/blob.bin")


def test_the_domain_way_https_http2_and_http1_through_a_replica(
    stack: dict[str, Any], sbx: Sandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second front door (same secret: a replica) with TLS from a test CA serves the E2B_DOMAIN way; the SDK
    connects by id and drives envd at https://49983-<id>.<domain> (a loopback CONNECT proxy stands in for DNS)."""
    ca, chain, key = tls_files(tmp_path / "tls", DOMAIN)
    ctx = ssl.create_default_context(cafile=str(ca))
    m = stack["master"]
    fd = FrontDoorProcess(
        tmp_path / "fd-tls", m.url, m.admin_key, "--domain", DOMAIN, "--cert", str(chain), "--key", str(key), verify=ctx
    )
    fd.secret_file.write_text(stack["fd"].secret_file.read_text())
    fd.start()
    proxy = ConnectProxy(("127.0.0.1", fd.port))
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        tls = {"api_key": stack["key"], "domain": DOMAIN, "proxy": proxy.url, "request_timeout": 300}
        there = Sandbox.connect(sbx.sandbox_id, **tls)
        assert there.commands.run("echo $FROM_CREATE over tls").stdout == "yes over tls\n"
        blob = os.urandom(MiB)
        there.files.write("/tmp/e2b/tls.bin", blob)
        assert sbx.files.read("/tmp/e2b/tls.bin", format="bytes") == blob  # the same guest, either way
        assert f"49983-{sbx.sandbox_id}.{DOMAIN}:443" in proxy.seen  # envd by Host name, not by header
        host = {"Host": f"49983-{sbx.sandbox_id}.{DOMAIN}", "X-Access-Token": sbx._envd_access_token or ""}
        for http2, version in ((True, "HTTP/2"), (False, "HTTP/1.1")):
            with httpx.Client(http2=http2, verify=ctx, base_url=f"https://127.0.0.1:{fd.port}", headers=host) as h:
                r = h.get("/health")
                assert (r.status_code, r.http_version) == (204, version)
                out = bytearray()
                wl = WorkloadClient(h, sbx._envd_access_token or "")
                run = wl.exec(["/bin/sh", "-c", "echo a; sleep 1; echo b"], on_stdout=out.extend)
                assert (run.exit_code, bytes(out)) == (0, b"a\nb\n"), run
    finally:
        proxy.close()
        fd.stop()


def test_set_timeout_connect_and_list_by_metadata(stack: dict[str, Any], sbx: Sandbox) -> None:
    sbx.set_timeout(1200)
    row = stack["master"].client.sandbox(sbx.sandbox_id)
    assert row.expires_at == pytest.approx(time.time() + 1200, abs=30)
    again = Sandbox.connect(sbx.sandbox_id, **opts(stack))  # a second client, from the id alone
    assert again.commands.run("echo $FROM_CREATE").stdout == "yes\n"
    assert (
        again.files.read("/tmp/e2b/chunked.bin", format="bytes")[:4]
        == sbx.files.read("/tmp/e2b/chunked.bin", format="bytes")[:4]
    )
    found = Sandbox.list(query=SandboxQuery(metadata={"suite": stack["tag"]}), **opts(stack)).next_items()
    assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "other"}), **opts(stack)).next_items() == []


def test_refusals_name_the_layer_a_wrong_key_and_another_tenant(stack: dict[str, Any], sbx: Sandbox) -> None:
    with pytest.raises(SandboxException) as e:  # more devices than the node has
        Sandbox.create(
            TEMPLATE, metadata={"cubeaccel.accelerators": '[{"class": "accelerator", "count": 8}]'}, **opts(stack)
        )
    assert "cubeaccel (scheduler)" in str(e.value) and f"{NODE}:" in str(e.value), e.value
    with pytest.raises(AuthenticationException):
        Sandbox.connect(sbx.sandbox_id, **opts(stack, api_key="cbk_0000_not-a-key"))
    other = stack["master"].client.request("POST", "/v1/tenants", {"name": "e2b-other"})["key"]
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id, **opts(stack, api_key=other))
    assert Sandbox.kill(sbx.sandbox_id, **opts(stack, api_key=other)) is False
    assert sbx.is_running()


def test_kill_twice_then_the_sandbox_is_gone_for_the_sdk(stack: dict[str, Any], sbx: Sandbox) -> None:
    dev = stack["master"].client.sandbox(sbx.sandbox_id).device_ids[0]
    streaming = sbx.commands.run("sleep 120", background=True)
    assert sbx.kill() is True
    with pytest.raises(SandboxNotRunningException) as killed:  # the stream is cut, /health says gone (E2B's way)
        streaming.wait()
    assert "killed or reached its end of life" in str(killed.value), killed.value
    assert sbx.kill() is False
    with pytest.raises(SandboxException) as e:
        sbx.commands.run("true")
    assert "was not found" in str(e.value), e.value
    assert not sbx.is_running()
    poll(lambda: stack["master"].client.sandbox(sbx.sandbox_id).state == "deleted", 90)
    poll(lambda: next(d for d in stack["cubelet"].client.devices() if d.id == dev).state == "allocatable", 60)


SDK_215 = "2.15.2"


def sdk_215_path() -> Path:
    return sdk_path(SDK_215)


def test_the_2_15_sdk_line_creates_runs_connects_and_kills(stack: dict[str, Any]) -> None:
    """After the module's sandbox is gone: its own create, run, connect and kill."""
    url = stack["fd"].url
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(sdk_215_path()),
        "E2B_API_KEY": stack["key"],
        "E2B_API_URL": url,
        "E2B_SANDBOX_URL": url,
    }
    r = subprocess.run(
        [sys.executable, "-s", str(Path(__file__).with_name("sdk_215_check.py")), TEMPLATE],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["version"] == SDK_215 and seen["connected"] is True
    assert (seen["stdout"], seen["exit_code"], seen["killed"], seen["killed_again"]) == (
        "2.15\nLinux\n",
        0,
        True,
        False,
    )
    assert stack["master"].client.sandbox(seen["sandbox_id"]).state in ("deleting", "deleted")


def test_the_2_45_sdk_line_sees_a_sandbox_killed_mid_command(stack: dict[str, Any]) -> None:
    """2.45 tells "killed" only from a cut connection and a health probe answering 502 (its own suite's
    test_kill_sandbox_while_command_is_running)."""
    seen = run_check("2.45.1", Path(__file__).with_name("sdk_kill_check.py"), [TEMPLATE], stack["key"], stack["fd"].url)
    assert seen["killed"] is True
    assert "TimeoutException" in seen["raised"], seen
    assert "sandbox was killed or reached its end of life" in seen["message"], seen


def test_a_guest_that_fails_validation_reaches_the_sdk_with_its_layer(
    stack: dict[str, Any], guest_image: Manifest
) -> None:
    stack["master"].client.register_template(edu_template(guest_image, "edu-e2b-needs-nvidia", modules=["nvidia"]))
    with pytest.raises(SandboxException) as e:
        Sandbox.create("edu-e2b-needs-nvidia", **opts(stack))
    msg = str(e.value)
    assert "cubeaccel (modules_img): compat.modules_img" in msg, msg
    failed = [s for s in stack["master"].client.sandboxes() if s.state == "failed"]
    assert failed and all(s.error.layer == "modules_img" for s in failed)
