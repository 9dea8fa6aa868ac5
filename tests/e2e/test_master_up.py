"""`cubeaccel up --detach`: CubeMaster + one Cubelet on free ports, example templates as class defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import cubeaccel
from cubeaccel.master.up import DEFAULTS, EXAMPLES, choose_backend, run_down, run_up
from cubeaccel.protocol.errors import CubeError
from cubeaccel.transport.cubelet_client import CubeletClient
from cubeaccel.transport.master_client import MasterClient
from tests.support.poll import poll


def test_backend_choice_says_which_and_why() -> None:
    backend, why = choose_backend("auto")
    assert backend in ("simulated", "emulated") and why
    assert choose_backend("simulated") == ("simulated", "asked for with --backend")
    with pytest.raises(CubeError) as e:
        choose_backend("magic")
    assert e.value.code == "up.unknown_backend"


def test_example_templates_are_package_data_so_an_installed_wheel_registers_them() -> None:
    """`up` must not read a source checkout: the defaults live inside the `cubeaccel` package (hatch puts every
    file under src/cubeaccel in the wheel) and are found through importlib.resources."""
    package = Path(cubeaccel.__file__).resolve().parent
    for name in DEFAULTS:
        found = EXAMPLES / name
        assert found.is_file(), name
        assert package in Path(str(found)).resolve().parents, f"{found} is outside the package"


def _descendants(roots: set[int]) -> set[int]:
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(roots), set(roots)
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def test_up_detached_registers_a_node_and_the_defaults_then_down_stops_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_up(tmp_path, "simulated", "h100x2", detach=True) == 0
    try:
        out = capsys.readouterr().out
        assert "backend: simulated — asked for with --backend" in out
        info = json.loads((tmp_path / "up.json").read_text())
        assert (tmp_path / "admin.key").stat().st_mode & 0o777 == 0o600
        secrets = [(tmp_path / f).read_text().strip() for f in ("admin.key", "default.key", "node-local.token")]
        for pid in info["pids"]:  # no credential on a command line (`ps`)
            argv = Path(f"/proc/{pid}/cmdline").read_text()
            assert not any(s in argv for s in secrets), argv
        c = MasterClient(info["master_url"], key=(tmp_path / "admin.key").read_text().strip())
        [node] = c.nodes()
        assert node.state == "ready" and node.total == 2
        defaults = c.request("GET", "/v1/templates")["defaults"]
        assert defaults == {"gpu": "cuda12-h100", "accelerator": "edu-demo"}
        made = c.create({"gpu": "H100:1"})
        assert made.state == "running"  # the example pins 64 GiB: up's node can lock it
        c.close()
        # no secret on the command line of anything up started, nor of their children (shims, VMMs) ...
        every = _descendants(set(info["pids"]))
        assert set(info["pids"]) <= every
        for pid in every:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except FileNotFoundError:
                continue
            assert not any(s in argv for s in secrets), argv
        # ... nor in any log, event or database under the state dir, but the key files themselves
        kept = {tmp_path / f for f in ("admin.key", "default.key", "node-local.token")}
        for f in tmp_path.rglob("*"):
            if f.is_file() and f not in kept and not f.is_socket():
                data = f.read_bytes()
                assert not any(s.encode() in data for s in secrets), f
    finally:
        assert run_down(tmp_path) == 0
    assert not (tmp_path / "up.json").exists()


def test_down_ends_the_sandboxes_up_started_through_the_release_path(tmp_path: Path) -> None:
    """Issue 19 #7: `down` stopped the daemons and left every sandbox's shim and VMM running. It now deletes
    them through CubeMaster and waits until the Cubelet holds nothing (its store says so after the stop)."""
    import sqlite3

    assert run_up(tmp_path, "simulated", "h100x2", detach=True) == 0
    try:
        info = json.loads((tmp_path / "up.json").read_text())
        c = MasterClient(info["master_url"], key=(tmp_path / "default.key").read_text().strip())
        ids = [c.create({"gpu": "H100:1"}).id for _ in range(2)]
        c.close()
    finally:
        assert run_down(tmp_path) == 0
    with sqlite3.connect(tmp_path / "cubelet" / "cubelet.db") as db:
        assert db.execute("SELECT sandbox_id FROM reservations").fetchall() == []
        closed = {r[0] for r in db.execute("SELECT sandbox_id FROM events WHERE kind = 'reservation_closed'")}
        states = {r[0] for r in db.execute("SELECT state FROM devices")}
    assert closed == set(ids) and states == {"allocatable"}
    with sqlite3.connect(tmp_path / "master.db") as db:
        assert {r[0] for r in db.execute("SELECT state FROM sandboxes")} == {"deleted"}


def test_up_keeps_a_warm_sandbox_of_the_default_template_and_down_drains_it_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 28: `up --warm 1` (the CLI's default) keeps one warm sandbox of its backend's default template and
    says what it pins; `down` drains the pool first (teardown `warm.drained`, no refill behind the release)."""
    import sqlite3

    assert run_up(tmp_path, "simulated", "h100x4", detach=True, warm=1) == 0
    try:
        assert "warm pool: 1 x cuda12-h100 kept started (pins 65536 MiB; --warm 0 turns it off)" in (
            capsys.readouterr().out
        )
        node = CubeletClient(socket=tmp_path / "cubelet" / "cubelet.sock")
        poll(lambda: node.request("GET", "/v1/warm/pools")["pools"][0]["warm"] == 1, 30, what="one warm sandbox")
        (pool,) = node.request("GET", "/v1/warm/pools")["pools"]
        assert pool["template"] == "cuda12-h100" and pool["size"] == 1
        info = json.loads((tmp_path / "up.json").read_text())
        c = MasterClient(info["master_url"], key=(tmp_path / "default.key").read_text().strip())
        made = c.create({"gpu": "H100:1"})  # warm when the heartbeat already advertised the pool, else cold
        tenant = made.id
        path = next(p.model_dump()["path"] for p in made.timeline if p.phase == "path")
        c.close()
        node.close()
    finally:
        assert run_down(tmp_path) == 0
    with sqlite3.connect(tmp_path / "cubelet" / "cubelet.db") as db:
        assert db.execute("SELECT sandbox_id FROM reservations").fetchall() == []
        teardowns = db.execute("SELECT sandbox_id, reason FROM events WHERE kind = 'teardown_started' ORDER BY seq")
        order = [(sid.startswith("warm-"), reason) for sid, reason in teardowns.fetchall()]
        warm_ids = {r[0] for r in db.execute("SELECT sandbox_id FROM events WHERE sandbox_id LIKE 'warm-%'")}
    assert order == [(True, "warm.drained"), (False, "sandbox_deleted")] and tenant
    assert len(warm_ids) == (2 if path == "warm" else 1)  # a claim's refill, and none started behind the drain


def test_up_with_warm_0_keeps_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_up(tmp_path, "simulated", "h100x2", detach=True, warm=0) == 0
    try:
        assert "warm pool: off (--warm 0)" in capsys.readouterr().out
        node = CubeletClient(socket=tmp_path / "cubelet" / "cubelet.sock")
        assert node.request("GET", "/v1/warm/pools")["pools"] == []
        node.close()
    finally:
        assert run_down(tmp_path) == 0


def test_up_after_down_refills_its_pool_and_warm_0_then_keeps_none(tmp_path: Path) -> None:
    """`down` drains the Cubelet's pools (kept in its journal); the next `up` on the same state directory brings
    its own warm config (`--warm-reset`): the pool refills, and with `--warm 0` there is none."""

    def pools() -> list[dict[str, Any]]:
        node = CubeletClient(socket=tmp_path / "cubelet" / "cubelet.sock")
        try:
            reply = node.request("GET", "/v1/warm/pools")
            assert reply["draining"] is False, reply
            return list(reply["pools"])
        finally:
            node.close()

    for warm in (1, 1, 0):
        assert run_up(tmp_path, "simulated", "h100x4", detach=True, warm=warm) == 0
        try:
            if warm:
                poll(lambda: [p["warm"] for p in pools()] == [1], 30, what="the pool warm again")
            else:
                assert pools() == []
        finally:
            assert run_down(tmp_path) == 0


def test_up_after_an_example_changed_registers_it_as_a_new_version_and_warms_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upgrade (or a re-pin) changes an example template while the state directory keeps the old document
    under the same version: `up` registers the new one as `<version>.<hex>` (the same on every later `up`), and
    its warm pool keeps that document, so the pool's contract is the one creates carry."""
    import cubeaccel.master.up as up

    def pools() -> list[dict[str, Any]]:
        node = CubeletClient(socket=tmp_path / "cubelet" / "cubelet.sock")
        try:
            return list(node.request("GET", "/v1/warm/pools")["pools"])
        finally:
            node.close()

    original = up.example_document
    assert run_up(tmp_path, "simulated", "h100x4", detach=True, warm=1) == 0
    assert run_down(tmp_path) == 0

    def changed(name: str, *args: Any, **kw: Any) -> dict[str, Any]:
        doc = original(name, *args, **kw)
        return {**doc, "metadata": {**doc["metadata"], "description": "after an upgrade"}}

    monkeypatch.setattr(up, "example_document", changed)
    versions = []
    for _ in range(2):
        assert run_up(tmp_path, "simulated", "h100x4", detach=True, warm=1) == 0
        try:
            info = json.loads((tmp_path / "up.json").read_text())
            admin = MasterClient(info["master_url"], key=(tmp_path / "admin.key").read_text().strip())
            shown = admin.request("GET", "/v1/templates/cuda12-h100")
            admin.close()
            versions.append(shown["version"])
            poll(lambda: [p["warm"] for p in pools()] == [1], 30, what="the new version's pool warm")
        finally:
            assert run_down(tmp_path) == 0
    assert versions[0] == versions[1] and versions[0].startswith("1."), versions
