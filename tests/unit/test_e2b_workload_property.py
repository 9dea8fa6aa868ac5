"""The E2B detail of a sandbox whose workload service stopped answering still parses in each SDK line of
docs/e2b.md's matrix (2.15.2, 2.45.1, the pinned 2.63.0): `state` stays `running`, and the extra `workload`
property lands among the generated model's additional properties."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cubeaccel.frontdoor import mapping
from cubeaccel.wire.master_api import Sandbox
from tests.support.e2b_sdk import sdk_path

LINES = ("2.15.2", "2.45.1", "2.63.0")  # 2.63.0: the pinned dev dependency, importable here
PARSE = """
import json, sys
from e2b.api.client.models.sandbox_detail import SandboxDetail
d = SandboxDetail.from_dict(json.loads(sys.stdin.read()))
print(json.dumps({"state": str(getattr(d.state, "value", d.state)), "extra": d.additional_properties}))
"""


def _stalled() -> Sandbox:
    entry = {"at": 5.0, "phase": "workload_unresponsive", "since": 4.0, "reason": "workload.unresponsive"}
    return Sandbox.model_validate(
        {
            "id": "sb-stalled",
            "tenant": "t",
            "node": "n",
            "class": "gpu",
            "count": 1,
            "device_ids": [],
            "template": None,
            "request": None,
            "error": None,
            "timeline": [entry],
            "expires_at": None,
            "created_at": 1.0,
            "updated_at": 5.0,
            "state": "running",
            "workload": {"state": "unresponsive", "reason": "workload.unresponsive", "since": 4.0},
        }
    )


@pytest.mark.parametrize("line", LINES)
def test_an_unchanged_sdk_reads_the_workload_condition_as_an_extra_property(line: str) -> None:
    body = mapping.detail(_stalled(), "tok", None).body()
    assert body["workload"] == {"state": "unresponsive", "reason": "workload.unresponsive", "since": mapping.iso(4.0)}
    env = {} if line == LINES[-1] else {"PYTHONPATH": str(sdk_path(line))}
    cmd = [sys.executable, *([] if line == LINES[-1] else ["-s"]), "-c", PARSE]
    r = subprocess.run(cmd, input=json.dumps(body), capture_output=True, text=True, env=env or None, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["state"] == "running"
    assert seen["extra"]["workload"]["reason"] == "workload.unresponsive"
