"""The TOML config file: precedence flag > environment > file > default, every setting documented, typos refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer

from cubeaccel.cli import config
from cubeaccel.cli.root import app
from cubeaccel.images.builder import cache_dir
from cubeaccel.protocol.errors import CubeError

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "config.md"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUBEACCEL_") and k != "XDG_CONFIG_HOME"}
    env["XDG_CONFIG_HOME"] = "/nonexistent"  # no user config file leaks into a test
    return {**env, **extra}


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cubeaccel", *args], capture_output=True, text=True, env=env, check=False, timeout=60
    )


def _error(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode != 0
    return str(json.loads(out.stdout)["error"]["message"])


def test_a_flag_beats_the_environment_beats_the_file_beats_the_default(tmp_path: Path) -> None:
    """Observed through the place `devices` looks for its Cubelet (the error names the socket it tried)."""
    f = tmp_path / "c.toml"
    f.write_text('[devices]\nstate-dir = "/from/file"\n')
    base = _clean_env(CUBEACCEL_STATE_DIR=str(tmp_path / "default"), CUBEACCEL_UP_STATE_DIR=str(tmp_path / "no-up"))
    assert str(tmp_path / "default" / "cubelet.sock") in _error(_cli(base, "devices", "-o", "json"))
    assert "/from/file/cubelet.sock" in _error(_cli(base, "--config", str(f), "devices", "-o", "json"))
    env = {**base, "CUBEACCEL_DEVICES_STATE_DIR": "/from/env"}
    assert "/from/env/cubelet.sock" in _error(_cli(env, "--config", str(f), "devices", "-o", "json"))
    flag = _cli(env, "--config", str(f), "devices", "--state-dir", "/from/flag", "-o", "json")
    assert "/from/flag/cubelet.sock" in _error(flag)


def test_top_level_settings_follow_the_same_order(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('master_url = "http://127.0.0.1:9"\n')
    base = _clean_env(CUBEACCEL_UP_STATE_DIR=str(tmp_path))
    assert "http://127.0.0.1:7700" in _error(_cli(base, "nodes", "-o", "json"))
    assert "http://127.0.0.1:9 " in _error(_cli({**base, "CUBEACCEL_CONFIG": str(f)}, "nodes", "-o", "json"))
    env = {**base, "CUBEACCEL_CONFIG": str(f), "CUBEACCEL_MASTER": "http://127.0.0.1:8"}
    assert "http://127.0.0.1:8 " in _error(_cli(env, "nodes", "-o", "json"))
    assert "http://127.0.0.1:7 " in _error(_cli(env, "nodes", "--master", "http://127.0.0.1:7", "-o", "json"))


def test_the_files_settings_reach_code_that_reads_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "c.toml"
    f.write_text(f'cache_dir = "{tmp_path / "cache"}"\naccel = "tcg"\n')
    monkeypatch.delenv("CUBEACCEL_CACHE_DIR", raising=False)
    monkeypatch.setenv("CUBEACCEL_ACCEL", "kvm")  # already set: the environment wins
    config.prepare(f)
    assert cache_dir() == tmp_path / "cache"
    assert os.environ["CUBEACCEL_ACCEL"] == "kvm"


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[devices]\nstatedir = 1\n", "statedir"),
        ("[nosuchcommand]\nx = 1\n", "nosuchcommand"),
        ('accel = "xen"\n', "accel"),
        ("not toml [", "not TOML"),
    ],
)
def test_a_typo_is_refused_naming_it(tmp_path: Path, text: str, names: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    out = _cli(_clean_env(), "--config", str(f), "devices")
    assert out.returncode == 2
    [line] = out.stderr.strip().splitlines()
    assert "config.invalid" in line and names in line


def test_the_reference_in_docs_is_generated_from_the_command_tree() -> None:
    out = subprocess.run([sys.executable, "scripts/config-doc.py", "--check"], cwd=ROOT, env=_clean_env(), check=False)
    assert out.returncode == 0, "docs/config.md is stale: run `python scripts/config-doc.py`"


def test_every_environment_variable_the_code_reads_is_documented() -> None:
    doc = DOC.read_text()
    used = set()
    for path in (ROOT / "src" / "cubeaccel").rglob("*.py"):
        used |= set(re.findall(r"\"(CUBEACCEL_[A-Z_]+)\"", path.read_text()))
    missing = sorted(v for v in used if v != "CUBEACCEL_" and v not in doc)
    assert missing == []
    assert {"CUBEACCEL_MASTER", "CUBEACCEL_CACHE_DIR", "CUBEACCEL_HTTP_BODY_TIMEOUT_S"} <= used  # the scan sees them


def test_the_example_in_docs_is_a_valid_file(tmp_path: Path) -> None:
    block = DOC.read_text().split("```toml", 1)[1].split("```", 1)[0]
    tables = config.split(tomllib.loads(block))
    config.load_settings(None, tomllib.loads(block))
    assert config.default_map(typer.main.get_command(app), tables[1], tmp_path)["cubelet"]["serve"]["backend"] == "vfio"
    with pytest.raises(CubeError):
        config.default_map(typer.main.get_command(app), {"cubelet": {"serve": {"bakend": "x"}}}, tmp_path)
