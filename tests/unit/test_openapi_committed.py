"""The OpenAPI documents committed in docs/openapi are the ones the servers serve: an API change shows in a diff.

Regenerate with `python scripts/openapi-doc.py` after changing a route or a wire model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from cubeaccel.cubelet.server import create_app as cubelet_app
from cubeaccel.frontdoor.app import REST_ROUTES
from cubeaccel.frontdoor.openapi import e2b_openapi
from cubeaccel.master.server import create_app as master_app
from cubeaccel.master.service import CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from tests.support.cubelet_harness import Node

ROOT = Path(__file__).resolve().parents[2]
STALE = "docs/openapi/{} differs from what is served: run `python scripts/openapi-doc.py` and commit the diff"


def _committed(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((ROOT / "docs" / "openapi" / name).read_text())
    return doc


def test_cubemaster_serves_the_committed_document(tmp_path: Path) -> None:
    store = MasterStore(str(tmp_path / "m.db"))
    try:
        served = TestClient(master_app(CubeMaster(store, MasterConfig()))).get("/openapi.json").json()
    finally:
        store.close()
    assert served == _committed("cubemaster.json"), STALE.format("cubemaster.json")


def test_the_cubelet_serves_the_committed_documents(node: Node) -> None:
    served = TestClient(cubelet_app(node.cubelet, local=True)).get("/openapi.json").json()
    assert served == _committed("cubelet-unix.json"), STALE.format("cubelet-unix.json")
    # The TCP listener answers CubeMaster's signed requests only; its document is what it would serve.
    assert cubelet_app(node.cubelet, local=False, token="t").openapi() == _committed("cubelet-tcp.json"), STALE.format(
        "cubelet-tcp.json"
    )


def test_the_front_door_documents_every_rest_route_and_the_committed_document_is_current() -> None:
    doc = e2b_openapi()
    documented = {(m.upper(), path) for path, item in doc["paths"].items() for m in item}
    assert documented == {(m, p) for m, p, _ in REST_ROUTES}
    assert doc == _committed("frontdoor-e2b.json"), STALE.format("frontdoor-e2b.json")


def test_the_regeneration_script_writes_what_is_committed() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/openapi-doc.py", "--check"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
