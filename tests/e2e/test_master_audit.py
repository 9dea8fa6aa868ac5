"""A scripted operator + tenant session against a real CubeMaster: every mutation is in the audit log exactly
once, with who did it; `cubeaccel audit --verify` finds an edited and a removed line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from cubeaccel.model.errors import CubeError
from cubeaccel.wire.master_client import MasterClient
from tests.support.master_harness import Cluster, example
from tests.support.poll import poll

PROFILES = {"n1": "2xh100"}


def audit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cubeaccel", "audit", *args], capture_output=True, text=True, timeout=60
    )


def test_a_scripted_session_is_audited_once_per_mutation_and_verify_finds_tampering(c: Cluster, tmp_path: Path) -> None:
    admin = c.c
    made = admin.request("POST", "/v1/tenants", {"name": "acme", "quota": {"max_sandboxes": 1}})
    acme = MasterClient(c.master.url, key=made["key"])
    extra = admin.request("POST", "/v1/tenants/acme/keys")
    admin.register_template(example("edu-demo", metadata__name="audited-edu"))
    admin.request("DELETE", "/v1/templates/audited-edu")
    sb = acme.create({"gpu": "H100:1"})
    with pytest.raises(CubeError) as e:  # a quota denial
        acme.create({"gpu": "H100:1"})
    assert e.value.code == "quota.sandboxes"
    acme.delete(sb["id"])
    poll(lambda: acme.sandbox(sb["id"])["state"] == "deleted")
    admin.node_verb("n1", "drain")
    admin.node_verb("n1", "undrain")
    admin.request("DELETE", f"/v1/keys/{extra['key_id']}")
    with pytest.raises(CubeError) as e:  # an authentication failure
        MasterClient(c.master.url, key=extra["key"]).sandboxes()
    assert e.value.code == "auth.invalid_credential"
    acme.close()

    log = c.master.audit_log
    entries = [json.loads(x) for x in log.read_text().splitlines()]
    assert log.stat().st_mode & 0o777 == 0o600
    mine = [e for e in entries if not e["identity"].startswith("node:") and e["action"] != "template:register"]
    seen = Counter((e["action"], e["outcome"], e.get("reason")) for e in mine if e["target"] != "/v1/templates")
    for action in (
        "tenant:create",
        "key:create",
        "template:delete",
        "sandbox:delete",
        "key:revoke",
    ):
        assert seen[(action, "ok", None)] == 1, (action, seen)
    assert seen[("sandbox:create", "ok", None)] == 1 and seen[("sandbox:create", "refused", "quota.sandboxes")] == 1
    assert seen[("node:verb", "ok", None)] == 2
    assert seen[("sandbox:list", "refused", "auth.invalid_credential")] == 1
    registered = [e for e in entries if e["action"] == "template:register" and e["outcome"] == "ok"]
    assert len(registered) == 4  # the harness's three and this session's one
    create = next(e for e in mine if e["action"] == "sandbox:create" and e["outcome"] == "ok")
    assert create["identity"].startswith("tenant:acme/") and create["tenant"] == "acme" and create["request_id"]
    assert made["key"] not in log.read_text() and extra["key"] not in log.read_text()  # never a secret

    ok = audit("--file", str(log), "--verify")
    assert ok.returncode == 0 and "intact" in ok.stdout, ok.stdout + ok.stderr
    lines = log.read_text().splitlines()
    edited = tmp_path / "edited.jsonl"
    edited.write_text("\n".join([*lines[:3], lines[3].replace('"ok"', '"refused"'), *lines[4:]]) + "\n")
    bad = audit("--file", str(edited), "--verify")
    assert bad.returncode == 1 and "line 4: hash" in bad.stdout, bad.stdout
    removed = tmp_path / "removed.jsonl"
    removed.write_text("\n".join([*lines[:3], *lines[4:]]) + "\n")
    bad = audit("--file", str(removed), "--verify")
    assert bad.returncode == 1 and "line 4: prev" in bad.stdout, bad.stdout
    q = audit("--file", str(log), "--tenant", "acme", "--action", "sandbox:")
    assert {json.loads(x)["action"] for x in q.stdout.splitlines()} == {"sandbox:create", "sandbox:delete"}


def test_the_cubelet_audits_device_assignment_release_and_operator_verbs(c: Cluster) -> None:
    node = c.cubelets["n1"]
    sb = c.c.create({"gpu": "H100:1"})
    c.c.delete(sb["id"])
    poll(lambda: c.c.sandbox(sb["id"])["state"] == "deleted")
    dev = node.client.devices()[0]["id"]
    node.client.verb(dev, "quarantine", "ops", "suspect")
    node.client.verb(dev, "recover", "ops", "checked")
    log = node.state_dir / "audit.jsonl"
    entries = [json.loads(x) for x in log.read_text().splitlines()]
    mine = Counter((e["action"], e["identity"]) for e in entries if sb["id"] in e["target"] or dev in e["target"])
    via_master = "node-token:n1 (CubeMaster)"
    assert mine[("device:assign", via_master)] == 0  # POST /v1/reservations names the sandbox in its body
    # one entry per release request; CubeMaster's maintenance may ask again while the release is under way
    assert mine[("device:release", via_master)] >= 1
    assert mine[("device:quarantine", "local-socket")] == 1 and mine[("device:recover", "local-socket")] == 1
    assigns = [e for e in entries if e["action"] == "device:assign" and e["identity"] == via_master]
    assert len(assigns) >= 1 and all(e["outcome"] == "ok" for e in assigns)
    assert audit("--file", str(log), "--verify").returncode == 0
