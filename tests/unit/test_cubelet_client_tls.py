"""CubeMaster keeps a Cubelet client per node; building each must not build a TLS context (~20 ms of CPU loading
the CA bundle: 200 s per replica meeting 10,000 nodes, found by bench/fleet_bench.py under a profiler)."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from cubeaccel.transport.cubelet_client import CubeletClient


def test_a_thousand_cubelet_clients_share_one_tls_context(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    CubeletClient(url="http://127.1.0.1:7701").close()  # the process's context exists from here on
    built: list[int] = []
    real = ssl.create_default_context

    def counted(*args: object, **kwargs: object) -> ssl.SSLContext:
        built.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl, "create_default_context", counted)
    clients = [CubeletClient(url=f"http://127.1.{i // 250}.{1 + i % 250}:7701", token="t") for i in range(1000)]
    clients.append(CubeletClient(socket=tmp_path / "cubelet.sock"))
    for c in clients:
        c.close()
    assert built == []
