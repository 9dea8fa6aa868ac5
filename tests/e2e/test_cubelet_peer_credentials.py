"""The Cubelet's unix socket takes only root and the Cubelet's own uid (SO_PEERCRED), whatever its file mode
says: a socket left 0666 by a mistake still refuses another local user, and audits who it was."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from cubeaccel.cubelet.server import create_app, local_uids
from cubeaccel.host.service.audit import AuditLog
from cubeaccel.transport.http_server import server_config
from tests.support.cubelet_harness import Node
from tests.support.poll import poll

NOBODY = 65534
# A child that imports what it needs (as root: ~root is private), drops to another uid, then calls the
# socket (the kernel records the caller's uid at connect()).
CALL = """
import os, sys, httpx
t = httpx.HTTPTransport(uds=sys.argv[1])
client = httpx.Client(transport=t, base_url="http://cubelet")
os.setgid({uid}); os.setuid({uid})
r = client.post(
    "/v1/devices/" + sys.argv[2] + "/quarantine", json={{"who": "mallory", "reason": "mine"}})
print(r.status_code, r.text)
"""


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Node, Path, Path]]:
    if os.geteuid() != 0:
        pytest.skip("needs root: the test drops a child to another uid")
    node = Node.create(tmp_path)
    where = Path(tempfile.mkdtemp(prefix="cubeaccel-peer-"))  # short path, open to all: the mistake under test
    os.chmod(where, 0o755)
    path = where / "cubelet.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o666)
    audit = tmp_path / "audit.jsonl"
    app = create_app(node.cubelet, local=True, audit=AuditLog(audit), peer_uids=local_uids())
    server = uvicorn.Server(server_config(app, fd=sock.fileno()))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    poll(lambda: server.started, what="the socket server started")
    yield node, path, audit
    server.should_exit = True
    thread.join(10)
    sock.close()
    path.unlink(missing_ok=True)
    where.rmdir()


def call_as(uid: int, path: Path, device_id: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", CALL.format(uid=uid), str(path), device_id],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_another_uid_is_refused_on_the_unix_socket_even_when_its_mode_lets_it_connect(
    served: tuple[Node, Path, Path],
) -> None:
    node, path, audit = served
    dev = node.devices()[0].id
    out = call_as(NOBODY, path, dev)
    assert out.startswith("403") and json.loads(out[4:])["error"]["code"] == "auth.peer_not_allowed", out
    assert node.device(dev).state.value == "allocatable"  # nothing changed
    entry = json.loads(audit.read_text().splitlines()[-1])
    assert (entry["outcome"], entry["reason"], entry["peer_uid"]) == ("refused", "auth.peer_not_allowed", NOBODY)

    out = call_as(0, path, dev)  # root (the Cubelet's own uid here) is served
    assert out.startswith("200"), out
    assert node.device(dev).state.value == "quarantined"
    entry = json.loads(audit.read_text().splitlines()[-1])
    assert (entry["action"], entry["outcome"], entry["peer_uid"]) == ("device:quarantine", "ok", 0)
