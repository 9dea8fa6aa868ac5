"""Other ports of a sandbox through the real e2b SDK and a real MicroVM: `python3 -m http.server 8000` started in a
`base` sandbox (the userland image) is fetched through `get_host(8000)` — plain http with E2B's port header, by
Host name, and https (HTTP/2 and 1.1) through a TLS replica — front door → Cubelet's workload proxy → the guest's
workload service → TCP 127.0.0.1:8000 in the guest. Tokens, a closed port, a port out of range and an Upgrade get
their catalogued refusals."""

from __future__ import annotations

import hashlib
import json
import os
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from cubeaccel.images.manifest import Manifest
from tests.e2b.test_e2b_cpu_only import base_template
from tests.e2b.test_e2b_vm import DOMAIN, opts, start_stack, stop_stack
from tests.support.frontdoor_process import ConnectProxy, FrontDoorProcess, tls_files
from tests.support.poll import poll
from tests.vm.conftest import userland_image

pytestmark = pytest.mark.vm
__all__ = ["userland_image"]

PORT = 8000
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, guest_image: Manifest, userland_image: Manifest
) -> Iterator[dict[str, Any]]:
    s = start_stack(tmp_path_factory.mktemp("e2b-ports"), guest_image)
    s["master"].client.register_template(base_template(userland_image))
    s["key"] = s["master"].tenant_key
    try:
        yield s
    finally:
        stop_stack(s)


@pytest.fixture(scope="module")
def served(stack: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A `base` sandbox serving /tmp/site on port 8000 with python's http.server (a background command)."""
    sbx = Sandbox.create(**opts(stack))
    try:
        blob = os.urandom(4 * MiB)
        sbx.files.write("/tmp/site/hello.txt", "hello from port 8000\n")
        sbx.files.write("/tmp/site/big.bin", blob)
        sbx.commands.run(f"cd /tmp/site && exec python3 -m http.server {PORT} --bind 127.0.0.1", background=True)
        by_header = port_headers(sbx, PORT, {"e2b-traffic-access-token": sbx.traffic_access_token or ""})
        url = stack["fd"].url

        def up() -> bool:
            return httpx.get(f"{url}/hello.txt", headers=by_header, timeout=30).status_code == 200

        poll(up, 120, what="http.server answers through the front door")
        yield {"sbx": sbx, "blob": blob, "url": url}
    finally:
        sbx.kill()


def port_headers(sbx: Sandbox, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Plain-http mode: the sandbox and port by E2B's headers (as the SDK addresses envd on one base URL)."""
    return {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(port), **(extra or {})}


def code_of(r: httpx.Response) -> str:
    body = json.loads(r.content)
    assert body["code"] == r.status_code, body
    return str(body["message"]).split(": ")[1]  # "cubeaccel (<layer>): <code>: <message>"


def test_http_server_in_the_sandbox_is_reached_by_the_port_header_and_by_get_host(served: dict[str, Any]) -> None:
    sbx, url = served["sbx"], served["url"]
    traffic = {"e2b-traffic-access-token": sbx.traffic_access_token or ""}
    r = httpx.get(f"{url}/hello.txt", headers=port_headers(sbx, PORT, traffic))
    assert (r.status_code, r.text) == (200, "hello from port 8000\n")
    assert "SimpleHTTP/" in r.headers["server"]  # python's own reply headers (the hops add their names)
    host = sbx.get_host(PORT)
    assert host == f"{PORT}-{sbx.sandbox_id}.{DOMAIN}"
    r = httpx.get(f"{url}/hello.txt", headers={"Host": host, **traffic})  # `http://<get_host>/…` without DNS
    assert (r.status_code, r.text) == (200, "hello from port 8000\n")
    listing = httpx.get(f"{url}/", headers={"Host": host, **traffic})
    assert listing.status_code == 200 and "big.bin" in listing.text
    head = httpx.head(f"{url}/big.bin", headers={"Host": host, **traffic})
    assert (head.status_code, head.headers["content-length"], head.content) == (200, str(4 * MiB), b"")
    # the sandbox's envd token reaches its ports too (the SDK holds it)
    r = httpx.get(f"{url}/hello.txt", headers=port_headers(sbx, PORT, {"X-Access-Token": sbx._envd_access_token or ""}))
    assert r.status_code == 200


def test_a_large_reply_streams_through_whole(served: dict[str, Any]) -> None:
    sbx, url, blob = served["sbx"], served["url"], served["blob"]
    traffic = {"e2b-traffic-access-token": sbx.traffic_access_token or ""}
    digest, size, pieces = hashlib.sha256(), 0, 0
    with httpx.stream("GET", f"{url}/big.bin", headers=port_headers(sbx, PORT, traffic), timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-length"] == str(len(blob))
        for piece in r.iter_raw():
            digest.update(piece)
            size, pieces = size + len(piece), pieces + 1
    assert (size, digest.hexdigest()) == (len(blob), hashlib.sha256(blob).hexdigest())
    assert pieces > 1  # arrived as it was read, not in one buffered piece


def test_ports_need_a_token_and_the_traffic_token_reaches_no_shell(served: dict[str, Any]) -> None:
    sbx, url = served["sbx"], served["url"]
    r = httpx.get(f"{url}/hello.txt", headers=port_headers(sbx, PORT))
    assert r.status_code == 403 and code_of(r) == "port.token_required"
    r = httpx.get(f"{url}/hello.txt", headers=port_headers(sbx, PORT, {"e2b-traffic-access-token": "x" * 43}))
    assert r.status_code == 403 and "hello" not in r.text
    traffic_as_envd = port_headers(sbx, 49983, {"X-Access-Token": sbx.traffic_access_token or ""})
    r = httpx.post(f"{url}/process.Process/List", json={}, headers={**traffic_as_envd, "Connect-Protocol-Version": "1"})
    assert r.status_code == 401  # the traffic token is for the app's ports, never envd's


def test_bad_ports_and_upgrades_get_catalogued_errors(served: dict[str, Any]) -> None:
    sbx, url = served["sbx"], served["url"]
    traffic = {"e2b-traffic-access-token": sbx.traffic_access_token or ""}
    r = httpx.get(f"{url}/", headers=port_headers(sbx, 8001, traffic))
    assert r.status_code == 502 and code_of(r) == "port.not_listening" and "8001" in r.text
    for bad in ("70000", "0", "http"):
        r = httpx.get(f"{url}/", headers={**port_headers(sbx, PORT, traffic), "E2b-Sandbox-Port": bad})
        assert r.status_code == 400 and code_of(r) == "port.invalid", (bad, r.text)
    r = httpx.get(f"{url}/", headers={"Host": f"99999-{sbx.sandbox_id}.{DOMAIN}", **traffic})
    assert r.status_code == 400 and code_of(r) == "port.invalid"
    upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13"}
    r = httpx.get(
        f"{url}/",
        headers={**port_headers(sbx, PORT, traffic), **upgrade, "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="},
    )
    assert r.status_code == 501 and code_of(r) == "port.upgrade_unsupported", r.text
    # the sandbox still serves after every refusal
    assert httpx.get(f"{url}/hello.txt", headers=port_headers(sbx, PORT, traffic)).status_code == 200


def test_https_through_get_host_over_http2_and_http1(
    stack: dict[str, Any], served: dict[str, Any], tmp_path: Path
) -> None:
    """`https://<get_host(8000)>/…` the E2B_DOMAIN way: a TLS replica (same secret), a CONNECT proxy for DNS."""
    sbx = served["sbx"]
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
        traffic = {"e2b-traffic-access-token": sbx.traffic_access_token or ""}
        for http2, version in ((True, "HTTP/2"), (False, "HTTP/1.1")):
            with httpx.Client(http2=http2, verify=ctx, proxy=proxy.url, headers=traffic, timeout=120) as h:
                r = h.get(f"https://{sbx.get_host(PORT)}/hello.txt")
                assert (r.status_code, r.http_version, r.text) == (200, version, "hello from port 8000\n")
                r = h.get(f"https://{sbx.get_host(PORT)}/big.bin")
                assert r.content == served["blob"]
        assert f"{PORT}-{sbx.sandbox_id}.{DOMAIN}:443" in proxy.seen
    finally:
        proxy.close()
        fd.stop()
