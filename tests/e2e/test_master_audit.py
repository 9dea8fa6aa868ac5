"""A scripted operator + tenant session against a real CubeMaster: every mutation is in the audit log exactly
once, with who did it; `cubeaccel audit --verify` finds an edited and a removed line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.master_client import MasterClient
from tests.support.master_harness import Cluster, example
from tests.support.poll import poll

PROFILES = {"n1": "2xh100"}


def audit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cubeaccel", "audit", *args], capture_output=True, text=True, timeout=60, env=env
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
    acme.delete(sb.id)
    poll(lambda: acme.sandbox(sb.id).state == "deleted")
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
    cut = tmp_path / "cut.jsonl"  # the last two lines removed: a valid chain, only shorter
    cut.write_text("\n".join(lines[:-2]) + "\n")
    (tmp_path / "cut.jsonl.head").write_bytes((log.parent / "audit.jsonl.head").read_bytes())
    bad = audit("--file", str(cut), "--verify")
    assert bad.returncode == 1 and "entries were cut off" in bad.stdout, bad.stdout
    (tmp_path / "cut.jsonl.head").unlink()  # the head file removed too: CubeMaster's database still has the seal
    last = json.loads(lines[-1])["seq"]  # sealed by a background writer: wait for it to reach the last line
    poll(lambda: any(s["seq"] >= last for s in admin.request("GET", "/v1/audit/seals")["seals"]))
    env = {**os.environ, "CUBEACCEL_API_KEY": c.master.admin_key}
    bad = audit("--file", str(cut), "--verify", "--master-seal", "--master", c.master.url, env=env)
    assert bad.returncode == 1 and "seal: seq" in bad.stdout and "cut off" in bad.stdout, bad.stdout + bad.stderr
    ok = audit("--file", str(log), "--verify", "--master-seal", "--master", c.master.url, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    q = audit("--file", str(log), "--tenant", "acme", "--action", "sandbox:")
    assert {json.loads(x)["action"] for x in q.stdout.splitlines()} == {"sandbox:create", "sandbox:delete"}


def test_the_cubelet_audits_device_assignment_release_and_operator_verbs(c: Cluster) -> None:
    node = c.cubelets["n1"]
    tenant = MasterClient(c.master.url, key=c.master.tenant_key)
    sb = tenant.create({"gpu": "H100:1"})
    during = time.time()
    tenant.delete(sb.id)
    poll(lambda: tenant.sandbox(sb.id).state == "deleted")
    record = tenant.sandbox(sb.id)
    tenant.close()
    assert len(record.device_ids) == 1  # CubeMaster keeps which devices the sandbox had, after its delete too
    dev = record.device_ids[0]
    poll(lambda: {d.id: d.state for d in node.client.devices()}[dev] == "allocatable")
    node.client.verb(dev, "quarantine", "ops", "suspect")
    node.client.verb(dev, "recover", "ops", "checked")
    log = node.state_dir / "audit.jsonl"
    entries = [json.loads(x) for x in log.read_text().splitlines()]
    mine = Counter((e["action"], e["identity"]) for e in entries if sb.id in e["target"] or dev in e["target"])
    via_master = "node-token:n1 (CubeMaster)"
    # one entry per release request; CubeMaster's maintenance may ask again while the release is under way
    assert mine[("device:release", via_master)] >= 1
    assert mine[("device:quarantine", "local-socket")] == 1 and mine[("device:recover", "local-socket")] == 1
    assigns = [e for e in entries if e["action"] == "device:assign" and e["identity"] == via_master]
    assert [(e["outcome"], e["sandbox"], e["tenant"]) for e in assigns if e.get("sandbox") == sb.id] == [
        ("ok", sb.id, "default")
    ]
    # the device's own custody: assigned (tenant, template, contract digest), attached, VMM gone, reset, released,
    # scrubbed, back in service; then the operator's quarantine and recovery, each naming who
    custody = [e for e in entries if e.get("device") == dev and e["identity"] == "cubelet"]
    custody = custody[next(i for i, e in enumerate(custody) if e.get("sandbox") == sb.id) :]  # this test's
    actions = [e["action"] for e in custody]
    for step in ("device:assigned", "device:attached", "device:teardown", "device:reset", "device:released"):
        assert step in actions, actions
    assert actions.index("device:assigned") < actions.index("device:released") < actions.index("device:allocatable")
    assigned = custody[actions.index("device:assigned")]
    assert (assigned["sandbox"], assigned["tenant"]) == (sb.id, "default")
    assert assigned["template"] and str(assigned["contract_digest"]).startswith("sha256:")
    assert [(e["action"], e.get("who")) for e in custody[-2:]] == [
        ("device:quarantined", "ops"),
        ("device:recovered", "ops"),
    ]
    ok = audit("--file", str(log), "--verify")
    assert ok.returncode == 0 and "intact" in ok.stdout, ok.stdout + ok.stderr
    who = audit("--file", str(log), "--device", dev, "--at", str(during))
    assert who.returncode == 0, who.stdout + who.stderr
    held = json.loads(who.stdout)["holder"]
    assert (held["tenant"], held["sandbox"], held["device"]) == ("default", sb.id, dev)
    after = json.loads(audit("--file", str(log), "--device", dev).stdout)  # now: nobody; the last was that tenant
    assert after["holder"] is None and after["previous"]["tenant"] == "default"


def test_an_admin_quarantines_and_recovers_a_device_through_cubemaster_and_a_tenant_cannot(c: Cluster) -> None:
    node = c.cubelets["n1"]
    dev = node.client.devices()[0].id
    cursor = node.client.events(limit=10000).next
    tenant = MasterClient(c.master.url, key=c.master.tenant_key)
    path = f"/v1/nodes/n1/devices/{dev}"
    with pytest.raises(CubeError) as e:
        tenant.request("POST", f"{path}/quarantine", {"reason": "mine now"})
    assert (e.value.code, e.value.status) == ("auth.forbidden", 403)
    with pytest.raises(CubeError) as e:
        tenant.request("GET", "/v1/nodes/n1/devices")
    assert e.value.status == 403
    tenant.close()
    assert node.client.devices()[0].state == "allocatable"  # the refusal changed nothing

    listed = c.c.request("GET", "/v1/nodes/n1/devices")["devices"]
    assert [d["id"] for d in listed] == [d.id for d in node.client.devices()]
    q = c.c.request("POST", f"{path}/quarantine", {"reason": "ECC errors"})
    assert (q["node"], q["device"]["id"], q["device"]["state"]) == ("n1", dev, "quarantined")
    assert node.client.devices()[0].state == "quarantined"
    with pytest.raises(CubeError) as e:  # the Cubelet's own refusal comes back with its code
        c.c.request("POST", "/v1/nodes/n1/devices/simulated-0000:ff:1f.7/recover", {"reason": "x"})
    assert e.value.code == "device.not_found"
    with pytest.raises(CubeError) as e:
        c.c.request("POST", f"/v1/nodes/nope/devices/{dev}/recover", {"reason": "x"})
    assert e.value.code == "node.not_found"
    r = c.c.request("POST", f"{path}/recover", {"reason": "checked"})
    assert r["device"]["state"] == "allocatable"

    master_log = [json.loads(x) for x in c.master.audit_log.read_text().splitlines()]
    mine = [e for e in master_log if e["target"].startswith(path)]
    assert [(e["action"], e["outcome"], e["identity"].split("/")[0]) for e in mine] == [
        ("device:quarantine", "refused", "tenant:default"),
        ("device:quarantine", "ok", "admin"),
        ("device:recover", "ok", "admin"),
    ]
    # the Cubelet did it for CubeMaster's node token, on the same request id, and its events name the admin
    node_log = [json.loads(x) for x in (node.state_dir / "audit.jsonl").read_text().splitlines()]
    ids = {e["request_id"] for e in mine[1:]}
    there = [e for e in node_log if e.get("request_id") in ids]
    assert [(e["action"], e["identity"]) for e in there] == [
        ("device:quarantine", "node-token:n1 (CubeMaster)"),
        ("device:recover", "node-token:n1 (CubeMaster)"),
    ]
    evs = node.client.events(cursor, limit=10000).events
    who = {ev.details["who"] for ev in evs if ev.device_id == dev and "who" in ev.details}
    assert who == {mine[1]["identity"]}


def test_the_device_cli_goes_through_cubemaster_with_node(c: Cluster) -> None:
    dev = c.cubelets["n1"].client.devices()[0].id
    env = {**os.environ, "CUBEACCEL_API_KEY": c.master.admin_key}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "cubeaccel", *args, "--node", "n1", "--master", c.master.url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)

    q = cli("device", "quarantine", dev, "--reason", "ECC")
    assert q.returncode == 0 and "quarantined" in q.stdout, q.stdout + q.stderr
    listed = cli("devices", "--json")
    assert json.loads(listed.stdout)["devices"][0]["state"] == "quarantined"
    r = cli("device", "recover", dev, "--reason", "clean")
    assert r.returncode == 0 and c.cubelets["n1"].client.devices()[0].state == "allocatable", r.stdout


def test_a_tenant_rotates_its_key_with_the_cli(c: Cluster, tmp_path: Path) -> None:
    made = c.c.request("POST", "/v1/tenants", {"name": "rotating"})
    old_id, old = made["key_id"], made["key"]

    def cli(key: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "CUBEACCEL_API_KEY": key}
        cmd = [sys.executable, "-m", "cubeaccel", "key", *args, "--master", c.master.url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)

    r = cli(old, "create", "--out", str(tmp_path / "new.key"))
    assert r.returncode == 0 and old not in r.stdout, r.stdout + r.stderr
    new = (tmp_path / "new.key").read_text().strip()
    assert new not in r.stdout and (tmp_path / "new.key").stat().st_mode & 0o777 == 0o600
    assert json.loads(r.stdout)["tenant"] == "rotating"
    listed = json.loads(cli(new, "list").stdout)
    assert {k["key_id"] for k in listed} == {old_id, json.loads(r.stdout)["key_id"]}
    assert cli(new, "revoke", old_id).returncode == 0
    with pytest.raises(CubeError) as e:
        MasterClient(c.master.url, key=old).sandboxes()
    assert e.value.code == "auth.invalid_credential"
    assert MasterClient(c.master.url, key=new).sandboxes() == []
    entries = [json.loads(x) for x in c.master.audit_log.read_text().splitlines()]
    done = Counter(e["action"] for e in entries if e.get("tenant") == "rotating" and e["outcome"] == "ok")
    assert done == {"tenant:create": 1, "key:create_own": 1, "key:revoke": 1}, done
