"""A real `cubeaccel api serve` process (the E2B front door) in front of a test's CubeMaster."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx

from tests.support.cubelet_process import terminate
from tests.support.master_harness import free_port
from tests.support.poll import poll


class FrontDoorProcess:
    def __init__(
        self,
        state_dir: Path,
        master_url: str,
        admin_key: str,
        *extra: str,
        host: str = "127.0.0.1",
        scheme: str = "http",
        verify: Any = True,  # an ssl.SSLContext trusting the test CA, for --cert
    ) -> None:
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"{scheme}://{host}:{self.port}"
        self.master_url = master_url
        self.extra = list(extra)
        self.verify = verify
        self.proc: subprocess.Popen[bytes] | None = None
        state_dir.mkdir(parents=True, exist_ok=True)
        self.admin_key_file = state_dir / "admin.key"
        self.admin_key_file.write_text(admin_key)
        self.admin_key_file.chmod(0o600)
        self.secret_file = state_dir / "frontdoor.secret"
        if not self.secret_file.exists():
            self.secret_file.write_text(secrets.token_urlsafe(32))

    def start(self) -> FrontDoorProcess:
        cmd = [
            sys.executable,
            "-m",
            "cubeaccel",
            "api",
            "serve",
            "--master",
            self.master_url,
            "--listen",
            f"127.0.0.1:{self.port}",
            "--admin-key-file",
            str(self.admin_key_file),
            "--secret-file",
            str(self.secret_file),
            *self.extra,
        ]
        log = open(self.state_dir / "frontdoor.log", "ab")  # noqa: SIM115 - child owns it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            try:
                return (
                    httpx.get(
                        f"https://127.0.0.1:{self.port}/health"
                        if "--cert" in self.extra
                        else f"http://127.0.0.1:{self.port}/health",
                        verify=self.verify,
                    ).status_code
                    == 200
                )
            except httpx.HTTPError:
                return False

        poll(up, 30, what="the front door answers /health")
        return self

    def log(self) -> str:
        p = self.state_dir / "frontdoor.log"
        return p.read_text(errors="replace")[-3000:] if p.exists() else ""

    def stop(self) -> None:
        terminate(self.proc)


class ConnectProxy:
    """An HTTP CONNECT proxy on loopback that sends every tunnel to one address: lets a client that resolves
    names itself (the SDK's Rust transport) reach `api.<domain>` and `49983-<id>.<domain>` on this machine
    without DNS or /etc/hosts. TLS stays end to end (the client's SNI and certificate check are untouched)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.seen: list[str] = []  # CONNECT authorities, in order
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._tunnel, args=(conn,), daemon=True).start()

    def _tunnel(self, conn: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 8192:
            chunk = conn.recv(4096)
            if not chunk:
                conn.close()
                return
            head += chunk
        line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(line) < 2 or line[0] != "CONNECT":
            conn.sendall(b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\n\r\n")
            conn.close()
            return
        self.seen.append(line[1])
        up = socket.create_connection(self.target)
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        rest = head.split(b"\r\n\r\n", 1)[1]
        if rest:
            up.sendall(rest)

        def pipe(a: socket.socket, b: socket.socket) -> None:
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=pipe, args=(up, conn), daemon=True).start()
        pipe(conn, up)
        conn.close()
        up.close()

    def close(self) -> None:
        self._closed = True
        self._sock.close()


def tls_files(directory: Path, domain: str) -> tuple[Path, Path, Path]:
    """(CA file, certificate chain, key) from a throwaway CA: `*.domain`, `domain` and 127.0.0.1."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert(f"*.{domain}", domain, "127.0.0.1")
    directory.mkdir(parents=True, exist_ok=True)
    ca_file, chain, key = directory / "ca.pem", directory / "chain.pem", directory / "key.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert.cert_chain_pems[0].write_to_path(str(chain))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(chain), append=True)
    cert.private_key_pem.write_to_path(str(key))
    key.chmod(0o600)
    return ca_file, chain, key
