"""The E2B REST surface through the real e2b SDK, against real CubeMaster and a simulated Cubelet (no VM: REST
calls never reach envd). The envd path with a real MicroVM is tests/e2b/test_e2b_vm.py."""

from __future__ import annotations

import hashlib
import json
import socket
import ssl
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox, SandboxQuery
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException

from cubeaccel.workload import ENVD_VERSION
from tests.support.e2b_sdk import run_check
from tests.support.frontdoor_process import ConnectProxy, FrontDoorProcess, tls_files
from tests.support.master_harness import Cluster, example

NODE = "fd-n1"
SDK_245 = "2.45.1"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("frontdoor")
    cl = Cluster(root, {NODE: "h100x8"})
    fd = FrontDoorProcess(root / "fd", cl.master.url, cl.master.admin_key).start()
    other = cl.c.request("POST", "/v1/tenants", {"name": "fd-other"})["key"]
    try:
        yield {"cluster": cl, "fd": fd, "key": cl.master.tenant_key, "other": other}
    finally:
        fd.stop()
        cl.stop()


def opts(stack: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    url = stack["fd"].url
    return {"api_key": key or stack["key"], "api_url": url, "sandbox_url": url, "request_timeout": 60}


def rest(stack: dict[str, Any], method: str, path: str, key: str | None = None, **kw: Any) -> httpx.Response:
    headers = {"X-API-Key": stack["key"] if key is None else key, **kw.pop("headers", {})}
    return httpx.request(method, stack["fd"].url + path, headers=headers, timeout=60, **kw)


def test_create_info_list_timeout_kill_through_the_sdk(stack: dict[str, Any]) -> None:
    tag = f"t{time.monotonic_ns()}"
    sbx = Sandbox.create("cuda12-h100", metadata={"suite": tag, "k": "v w"}, timeout=600, **opts(stack))
    row = stack["cluster"].c.sandbox(sbx.sandbox_id)
    assert row.state == "running" and row.tenant == "default" and row.accel_class == "gpu"
    assert row.request.metadata == {"suite": tag, "k": "v w"}
    assert row.expires_at - row.created_at == pytest.approx(600, abs=2)
    info = sbx.get_info()
    assert (info.sandbox_id, info.template_id, info.metadata, info.state.value) == (
        sbx.sandbox_id,
        "cuda12-h100",
        {"suite": tag, "k": "v w"},
        "running",
    )
    assert str(info.envd_version) == ENVD_VERSION
    other = Sandbox.create("cuda12-h100", metadata={"suite": tag, "k": "other"}, **opts(stack))
    found = Sandbox.list(query=SandboxQuery(metadata={"suite": tag, "k": "v w"}), **opts(stack)).next_items()
    assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
    both = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), **opts(stack)).next_items()
    assert {s.sandbox_id for s in both} == {sbx.sandbox_id, other.sandbox_id}
    sbx.set_timeout(30)
    end = sbx.get_info().end_at
    assert abs((end - datetime.now(UTC)).total_seconds() - 30) < 5
    assert stack["cluster"].c.sandbox(sbx.sandbox_id).expires_at == pytest.approx(time.time() + 30, abs=5)
    again = Sandbox.connect(sbx.sandbox_id, **opts(stack))
    assert again._envd_access_token == sbx._envd_access_token and again._envd_access_token
    assert sbx.kill() is True
    assert Sandbox.kill(sbx.sandbox_id, **opts(stack)) is False  # killed twice: the second finds nothing
    assert stack["cluster"].c.sandbox(sbx.sandbox_id).state in ("deleting", "deleted")
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id, **opts(stack))
    assert other.kill() is True


def test_an_unplaceable_gpu_request_raises_naming_the_layer_and_nodes(stack: dict[str, Any]) -> None:
    with pytest.raises(SandboxException) as e:
        Sandbox.create("cuda12-h100", metadata={"cubeaccel.accelerators": "H100:16"}, **opts(stack))
    msg = str(e.value)
    assert "cubeaccel (scheduler): schedule.unschedulable" in msg and f"{NODE}:" in msg, msg
    with pytest.raises(SandboxException) as e:
        Sandbox.create("no-such-template", **opts(stack))
    assert "template" in str(e.value), e.value
    r = rest(
        stack,
        "POST",
        "/v2/sandboxes",
        json={"templateID": "cuda12-h100", "metadata": {"cubeaccel.accelerators": '[{"class": "gpu", "count": 16}]'}},
    )
    assert r.status_code == 409 and r.headers["should-retry"] == "false"
    assert set(r.json()) == {"code", "message"} and r.json()["code"] == 409


def test_the_accelerators_key_overrides_the_templates_default(stack: dict[str, Any]) -> None:
    sbx = Sandbox.create("cuda12-h100", metadata={"cubeaccel.accelerators": "H100:2"}, **opts(stack))
    try:
        row = stack["cluster"].c.sandbox(sbx.sandbox_id)
        assert row.count == 2 and len(row.device_ids) == 2
    finally:
        sbx.kill()


def test_a_wrong_api_key_is_an_authentication_error(stack: dict[str, Any]) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create("cuda12-h100", **opts(stack, key="cbk_nope_wrong"))
    with pytest.raises(AuthenticationException):
        Sandbox.list(**opts(stack, key="cbk_nope_wrong")).next_items()


def test_another_tenants_sandbox_is_not_found(stack: dict[str, Any]) -> None:
    sbx = Sandbox.create("cuda12-h100", **opts(stack))
    try:
        theirs = opts(stack, key=stack["other"])
        with pytest.raises(NotFoundException):
            Sandbox.connect(sbx.sandbox_id, **theirs)
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sbx.sandbox_id, **theirs)
        assert Sandbox.kill(sbx.sandbox_id, **theirs) is False
        assert sbx.sandbox_id not in {s.sandbox_id for s in Sandbox.list(**theirs).next_items()}
        assert stack["cluster"].c.sandbox(sbx.sandbox_id).state == "running"
    finally:
        sbx.kill()


def test_the_old_create_route_answers_exactly_201_and_idempotency_keys_repeat(stack: dict[str, Any]) -> None:
    r = rest(stack, "POST", "/sandboxes", json={"templateID": "cuda12-h100"})
    assert r.status_code == 201, r.text
    first = r.json()
    assert {"templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken"} <= set(first)
    key = f"k-{time.monotonic_ns()}"
    a = rest(stack, "POST", "/v2/sandboxes", json={"templateID": "cuda12-h100"}, headers={"Idempotency-Key": key})
    b = rest(stack, "POST", "/v2/sandboxes", json={"templateID": "cuda12-h100"}, headers={"Idempotency-Key": key})
    assert (a.status_code, b.status_code) == (201, 201)
    assert a.json()["sandboxID"] == b.json()["sandboxID"] and a.json() == b.json()
    for sid in (first["sandboxID"], a.json()["sandboxID"]):
        assert rest(stack, "DELETE", f"/sandboxes/{sid}").status_code == 204


def test_list_pages_by_next_token(stack: dict[str, Any]) -> None:
    tag = f"p{time.monotonic_ns()}"
    made = [Sandbox.create("cuda12-h100", metadata={"page": tag}, **opts(stack)) for _ in range(3)]
    try:
        r = rest(stack, "GET", "/v2/sandboxes", params={"metadata": f"page={tag}", "limit": 2})
        assert r.status_code == 200 and len(r.json()) == 2 and r.headers.get("x-next-token")
        r2 = rest(
            stack,
            "GET",
            "/v2/sandboxes",
            params={"metadata": f"page={tag}", "limit": 2, "nextToken": r.headers["x-next-token"]},
        )
        assert len(r2.json()) == 1 and "x-next-token" not in r2.headers
        assert {s["sandboxID"] for s in r.json() + r2.json()} == {s.sandbox_id for s in made}
        pager = Sandbox.list(query=SandboxQuery(metadata={"page": tag}), limit=2, **opts(stack))
        seen = pager.next_items()
        assert pager.has_next
        seen += pager.next_items()
        assert not pager.has_next and {s.sandbox_id for s in seen} == {s.sandbox_id for s in made}
    finally:
        for s in made:
            s.kill()


def test_pause_snapshots_and_unknown_routes_are_refused_clearly(stack: dict[str, Any]) -> None:
    sbx = Sandbox.create("cuda12-h100", **opts(stack))
    try:
        with pytest.raises(SandboxException) as e:
            sbx.pause()
        assert "not supported" in str(e.value) and "paused" in str(e.value)
        for path in (f"/sandboxes/{sbx.sandbox_id}/snapshots", f"/sandboxes/{sbx.sandbox_id}/resume"):
            r = rest(stack, "POST", path, json={})
            assert (
                r.status_code == 400 and r.headers["should-retry"] == "false" and "not supported" in r.json()["message"]
            )
        r = rest(stack, "POST", "/v2/sandboxes", json={"templateID": "cuda12-h100", "autoPause": True})
        assert r.status_code == 400 and "autoPause" in r.json()["message"]
        r = rest(stack, "GET", "/nothing-here")
        assert r.status_code == 404 and set(r.json()) == {"code", "message"}
        r = rest(stack, "POST", "/v2/sandboxes", content=b"not json")
        assert r.status_code == 400 and r.json()["code"] == 400
        assert rest(stack, "GET", "/v2/sandboxes", key="").status_code == 401
    finally:
        sbx.kill()


def test_the_domain_way_over_https_and_http2(
    stack: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E2B_DOMAIN: REST at https://api.<domain>, with an operator certificate from a test CA. The SDK resolves
    names itself (Rust), so a loopback CONNECT proxy stands in for DNS; TLS is end to end."""
    ca, chain, key = tls_files(tmp_path / "tls", "e2b.test")
    ctx = ssl.create_default_context(cafile=str(ca))
    cl = stack["cluster"]
    fd = FrontDoorProcess(
        tmp_path / "fd-tls",
        cl.master.url,
        cl.master.admin_key,
        "--domain",
        "e2b.test",
        "--cert",
        str(chain),
        "--key",
        str(key),
        verify=ctx,
    )
    fd.secret_file.write_text(stack["fd"].secret_file.read_text())  # a replica: the same secret
    fd.start()
    proxy = ConnectProxy(("127.0.0.1", fd.port))
    try:
        with httpx.Client(http2=True, verify=ctx) as h2:
            r = h2.get(f"https://127.0.0.1:{fd.port}/v2/sandboxes", headers={"X-API-Key": stack["key"]})
            assert r.status_code == 200 and r.http_version == "HTTP/2", r
        with httpx.Client(http2=False, verify=ctx) as h1:
            r = h1.get(f"https://127.0.0.1:{fd.port}/v2/sandboxes", headers={"X-API-Key": stack["key"]})
            assert r.status_code == 200 and r.http_version == "HTTP/1.1", r
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        tls = {"api_key": stack["key"], "domain": "e2b.test", "proxy": proxy.url, "request_timeout": 60}
        sbx = Sandbox.create("cuda12-h100", metadata={"way": "domain"}, **tls)
        assert sbx.sandbox_domain == "e2b.test"
        listed = Sandbox.list(query=SandboxQuery(metadata={"way": "domain"}), **tls).next_items()
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
        # the plain replica hands out the same envd token: the secret, not a replica's memory, derives it
        assert Sandbox.connect(sbx.sandbox_id, **opts(stack))._envd_access_token == sbx._envd_access_token
        assert Sandbox.kill(sbx.sandbox_id, **tls) is True
        assert "api.e2b.test:443" in proxy.seen
    finally:
        proxy.close()
        fd.stop()


def test_the_envd_token_reaches_the_node_as_its_hash_and_is_stored_nowhere(stack: dict[str, Any]) -> None:
    sbx = Sandbox.create("cuda12-h100", envs={"SECRETISH": "v"}, **opts(stack))
    try:
        token = sbx._envd_access_token
        assert token and len(token) >= 32
        cl = stack["cluster"]
        row = cl.c.sandbox(sbx.sandbox_id)
        facts = cl.cubelets[NODE].client.reservation(sbx.sandbox_id).reservation.facts
        assert facts.workload_token_sha256 == hashlib.sha256(token.encode()).hexdigest()
        assert token not in row.model_dump_json() and row.request.env_vars == {"SECRETISH": "v"}
        for path in cl.root.rglob("*"):  # not in any file: databases, journals, logs, audit logs
            if path.is_file() and not path.is_socket() and path.stat().st_size < 64 * 1024 * 1024:
                assert token.encode() not in path.read_bytes(), path
    finally:
        sbx.kill()


def test_the_2_45_sdk_line_accepts_the_key_and_creates_lists_and_kills(stack: dict[str, Any]) -> None:
    """e2b 2.25.0-2.45.1 refuse a key that is not `e2b_<hex>` before sending anything (issue 29)."""
    tag = f"t{time.monotonic_ns()}"
    script = Path(__file__).with_name("sdk_rest_check.py")
    seen = run_check(SDK_245, script, ["cuda12-h100", tag], stack["key"], stack["fd"].url)
    assert (seen["template"], seen["listed"], seen["killed"], seen["killed_again"]) == (
        "cuda12-h100",
        [seen["sandbox_id"]],
        True,
        False,
    )


def test_lists_are_newest_first_and_filter_by_start_time_through_the_sdk(stack: dict[str, Any]) -> None:
    """Issue 29: E2B lists newest first, honours `order` and `startedAfter`."""
    tag = f"t{time.monotonic_ns()}"
    made = [Sandbox.create("cuda12-h100", metadata={"suite": tag}, **opts(stack)) for _ in range(3)]
    try:
        ids = [s.sandbox_id for s in made]
        q = SandboxQuery(metadata={"suite": tag})
        assert [s.sandbox_id for s in Sandbox.list(query=q, **opts(stack)).next_items()] == ids[::-1]
        oldest = Sandbox.list(query=q, order="asc", limit=2, **opts(stack))
        assert [s.sandbox_id for s in oldest.next_items()] + [s.sandbox_id for s in oldest.next_items()] == ids
        second = made[1].get_info().started_at
        q = SandboxQuery(metadata={"suite": tag}, started_after=second)
        assert [s.sandbox_id for s in Sandbox.list(query=q, **opts(stack)).next_items()] == [ids[2], ids[1]]
    finally:
        for s in made:
            s.kill()


def test_a_create_without_timeout_lives_e2bs_300_s_and_metrics_answer_as_e2b_documents(
    stack: dict[str, Any],
) -> None:
    sbx = Sandbox.create("cuda12-h100", **opts(stack))  # 2.63 sends no timeout at all
    row = stack["cluster"].c.sandbox(sbx.sandbox_id)
    assert row.expires_at - row.created_at == pytest.approx(300, abs=2)
    assert sbx.get_metrics() == []  # running on a simulated node: no guest, so nothing sampled (docs/e2b.md)
    assert sbx.kill() is True
    with pytest.raises(NotFoundException):
        Sandbox.get_metrics(sbx.sandbox_id, **opts(stack))
    with pytest.raises(NotFoundException):
        Sandbox.get_metrics("never-was", **opts(stack))


def test_a_create_right_after_a_kill_waits_for_the_devices_coming_back(stack: dict[str, Any]) -> None:
    """Issue 29: a killed sandbox's devices are released and scrubbed before they are allocatable; a create
    meanwhile waits for them (it used to be refused with `Should-Retry: false`, and the SDK gave up)."""
    stack["cluster"].cleanup()  # every device free: earlier tests' sandboxes would hold some (refused at once)
    every = {"cubeaccel.accelerators": "H100:8"}
    sbx = Sandbox.create("cuda12-h100", metadata=every, **opts(stack))
    assert sbx.kill() is True
    again = Sandbox.create("cuda12-h100", metadata=every, **opts(stack))
    try:
        assert len(stack["cluster"].c.sandbox(again.sandbox_id).device_ids) == 8
    finally:
        again.kill()
    stack["cluster"].cleanup()


def _reply(sock: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP/1.1 reply with a Content-Length body: (head, body); b"" head when the server closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b"", b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":", 1)[1] for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head.lower(), body


def test_a_reply_sent_before_its_body_was_read_tells_the_client_not_to_reuse_the_connection(
    stack: dict[str, Any],
) -> None:
    """CI found this through the isolation property test: the front door answers an envd call for an unknown
    sandbox from its headers; Hypercorn then closes the connection without saying so, and a client reusing it
    at once got "Server disconnected without sending a response". The reply must say `connection: close`, or
    the connection must serve the next request."""
    host, port = stack["fd"].url.removeprefix("http://").rsplit(":", 1)
    body = b'{"process": {"cmd": "/bin/true"}}'
    head = (
        f"POST /process.Process/Start HTTP/1.1\r\nHost: {host}\r\nE2b-Sandbox-Id: nobody{time.monotonic_ns()}\r\n"
        f"X-Access-Token: none\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)  # the body only once the reply is here
        first, _ = _reply(sock)
        assert first.startswith(b"http/1.1 4"), first
        if b"connection: close" in first:
            return
        sock.sendall(body + f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        second, _ = _reply(sock)
        assert second.startswith(b"http/1.1 "), "the connection was closed though its reply did not say so"


@pytest.mark.parametrize("line", ["2.15.2", SDK_245])
def test_older_sdk_lines_send_network_options_the_front_door_maps_or_refuses_by_name(
    stack: dict[str, Any], line: str
) -> None:
    """Issue 29: E2B's `network` and `allow_internet_access` were checked with 2.63 only; the older lines send
    their own body (`allowInternetAccess` always), which must map the same way."""
    seen = run_check(
        line,
        Path(__file__).with_name("sdk_network_check.py"),
        ["cuda12-h100", f"t{time.monotonic_ns()}"],
        stack["key"],
        stack["fd"].url,
    )
    assert seen["version"] == line
    asked = {
        name: stack["cluster"].c.sandbox(seen[name]["sandbox_id"]).request for name in ("deny_some", "no_internet")
    }
    assert asked["deny_some"].network["deny_out"] == ["10.1.2.0/24"]
    assert "0.0.0.0/0" in asked["no_internet"].network["deny_out"]
    assert "network.e2b_destination_unsupported" in seen["by_name"]["error"]
    assert "network.policy_widened" in seen["widened"]["error"]
    if line == SDK_245:  # its update_network sends 2.63's body (allowOut/denyOut/allow_internet_access)
        updated = stack["cluster"].c.sandbox(seen["updated"]["sandbox_id"]).request
        assert updated is not None and updated.network == {"allow_out": [], "deny_out": ["10.9.0.0/16"]}
    else:
        assert "updated" not in seen  # 2.15 has no update_network


def test_the_2_15_sdks_connect_names_the_sandbox_in_envds_headers_and_is_still_rest(stack: dict[str, Any]) -> None:
    """SDK 2.15's `Sandbox.connect` sends `POST /sandboxes/{id}/connect` with the API key and also
    `E2b-Sandbox-Id`/`E2b-Sandbox-Port: 49983`, the headers that mark envd traffic in plain-http mode: the front
    door answered it as envd (401, no access token) and every 2.15 connect failed."""
    sbx = Sandbox.create("cuda12-h100", timeout=120, **opts(stack))
    try:
        envd_headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
        r = rest(stack, "POST", f"/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 60}, headers=envd_headers)
        assert r.status_code in (200, 201), r.text
        assert r.json()["sandboxID"] == sbx.sandbox_id and r.json()["envdAccessToken"] == sbx._envd_access_token
        anonymous = httpx.post(f"{stack['fd'].url}/sandboxes/{sbx.sandbox_id}/connect", headers=envd_headers)
        assert anonymous.status_code == 401  # no API key: envd's, and refused for its missing token
        # a sandbox that line connected sends envd traffic with only its token: a token no sandbox has is envd's 401
        wrong = httpx.get(f"{stack['fd'].url}/health", headers={"X-Access-Token": "not-a-sandboxes-token"})
        assert (wrong.status_code, wrong.json()["message"]) == (401, "missing or wrong access token")
    finally:
        sbx.kill()


def test_update_network_replaces_a_running_sandboxs_policy_whole_on_its_node_recorded_and_audited(
    stack: dict[str, Any],
) -> None:
    """SDK 2.63's `update_network` (`PUT /sandboxes/{id}/network`): E2B's update replaces the egress configuration
    whole, so what it leaves out is cleared; CubeMaster records and audits it, the node journals it."""
    cl = stack["cluster"]
    tpl = example("cuda12-h100", metadata__name="fd-net", spec__memory__size_mib=1024)
    template_egress = ["192.0.2.0/24:443/tcp", "198.51.100.0/24:443/tcp"]
    tpl["spec"]["sandbox"] = {"network": {"mode": "allowlist", "egress": template_egress}}
    cl.c.register_template(tpl)
    sbx = Sandbox.create("fd-net", network={"deny_out": ["198.51.100.0/24"]}, **opts(stack))

    def policy() -> tuple[Any, Any]:
        row = cl.c.sandbox(sbx.sandbox_id)
        held = cl.cubelets[NODE].client.reservation(sbx.sandbox_id).reservation
        assert held is not None
        params = held.params
        node = None if params.network is None else params.network.model_dump()["egress"]
        return (row.request.network_policy or {}).get("egress"), node

    try:
        assert policy() == (["192.0.2.0/24:443/tcp"], ["192.0.2.0/24:443/tcp"])
        sbx.update_network({"allow_out": ["198.51.100.7"], "deny_out": ["0.0.0.0/0"]})
        assert policy() == (["198.51.100.7/32:443/tcp"], ["198.51.100.7/32:443/tcp"])
        row = cl.c.sandbox(sbx.sandbox_id)
        assert row.request.network == {"allow_out": ["198.51.100.7/32"], "deny_out": ["0.0.0.0/0"]}
        assert [t.model_dump()["egress"] for t in row.timeline if t.phase == "network_set"] == [
            ["198.51.100.7/32:443/tcp"]
        ]
        sbx.update_network({})  # nothing named: the template's whole allowlist again
        assert policy() == (template_egress, template_egress)
        Sandbox.update_network(sbx.sandbox_id, {"allow_internet_access": False}, **opts(stack))
        assert policy() == (None, None)  # E2B: denyOut 0.0.0.0/0
        for network, code in [
            ({"allow_out": ["api.example.com"]}, "network.e2b_destination_unsupported"),
            ({"egress_proxy": {"address": "proxy.test:1080"}}, "network.e2b_option_unsupported"),
            ({"allow_out": ["203.0.113.9"], "deny_out": ["0.0.0.0/0"]}, "network.policy_widened"),
        ]:
            with pytest.raises(SandboxException) as e:
                sbx.update_network(network)  # type: ignore[arg-type]
            assert code in str(e.value)
        assert policy() == (None, None)  # refused: nothing changed
        r = rest(stack, "PUT", f"/sandboxes/{sbx.sandbox_id}/network", json={"allowOut": []}, key=stack["other"])
        assert r.status_code == 404  # another tenant's
        audited = [json.loads(line) for line in cl.master.audit_log.read_text().splitlines()]
        mine = [
            (a["outcome"], a["status"]) for a in audited if a["target"] == f"/v1/sandboxes/{sbx.sandbox_id}/network"
        ]
        assert [a for a in audited if a["action"] == "sandbox:set_network"] and mine.count(("ok", 200)) == 3
    finally:
        sbx.kill()
    with pytest.raises(NotFoundException):
        Sandbox.update_network(sbx.sandbox_id, {}, **opts(stack))


def test_an_update_the_node_refuses_leaves_the_sandboxs_record_and_journal_as_they_were(stack: dict[str, Any]) -> None:
    """CubeMaster cannot know a node's sandbox address pool: the Cubelet refuses an allowlist that reaches it
    (`network.pool_overlap`), and nothing is recorded anywhere."""
    cl = stack["cluster"]
    tpl = example("cuda12-h100", metadata__name="fd-net-pool", spec__memory__size_mib=1024)
    tpl["spec"]["sandbox"] = {"network": {"mode": "allowlist", "egress": ["100.64.0.0/10:443"]}}
    cl.c.register_template(tpl)
    sbx = Sandbox.create("fd-net-pool", network={"deny_out": ["100.96.0.0/16"]}, **opts(stack))
    try:
        before = cl.c.sandbox(sbx.sandbox_id)
        held = cl.cubelets[NODE].client.reservation(sbx.sandbox_id).reservation
        assert held is not None and before.request.network_policy is not None
        with pytest.raises(SandboxException) as e:
            sbx.update_network({})  # the template's whole allowlist, the node's pool 100.96.0.0/16 with it
        assert "cubeaccel (cubelet): network.pool_overlap" in str(e.value)
        after = cl.c.sandbox(sbx.sandbox_id)
        assert (after.request, after.timeline) == (before.request, before.timeline)
        again = cl.cubelets[NODE].client.reservation(sbx.sandbox_id).reservation
        assert again is not None and again.params == held.params
    finally:
        sbx.kill()
