"""Issue 19 #9: CubeMaster never silently replaces a request's memory_mib; its limits agree with Cubelet's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from pydantic import ValidationError

from cubeaccel.master.server import create_app
from cubeaccel.master.service import CubeMaster, MasterConfig
from cubeaccel.master.store import MasterStore
from cubeaccel.master.up import EXAMPLES
from cubeaccel.model.limits import MAX_MEMORY_MIB
from cubeaccel.wire.cubelet_api import ReservationBody
from cubeaccel.wire.master_api import SandboxBody
from tests.support.master_builders import Credentials


@pytest.fixture
def api(tmp_path: Path) -> TestClient:
    m = CubeMaster(MasterStore(str(tmp_path / "m.db")), MasterConfig())
    m.registry.register(yaml.safe_load((EXAMPLES / "cuda12-h100.yaml").read_text()), default=True)
    client = TestClient(create_app(m), raise_server_exceptions=False)
    client.auth = Credentials(m)
    return client


def test_a_memory_size_other_than_the_templates_is_refused_not_replaced(api: TestClient) -> None:
    need = api.get("/v1/templates/cuda12-h100").json()["document"]["spec"]["memory"]["size_mib"]
    r = api.post("/v1/sandboxes", json={"gpu": "H100:1", "memory_mib": 1024})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "request.memory_mismatch" and err["details"]["template_memory_mib"] == need
    assert api.get("/v1/sandboxes").json()["sandboxes"] == []


def test_cubemaster_and_cubelet_bound_memory_alike() -> None:
    over = MAX_MEMORY_MIB + 1
    for model, body in (
        (SandboxBody, {"memory_mib": over}),
        (ReservationBody, {"sandbox_id": "a", "memory_mib": over}),
    ):
        with pytest.raises(ValidationError):
            model.model_validate(body)
        model.model_validate({**body, "memory_mib": MAX_MEMORY_MIB})
