"""Every list command under `-o json` (and yaml) prints one parseable document: the result against a running
`up` stack (found the way `sandbox` finds it), a JSON error naming the URL or socket when nothing runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cubeaccel.master.up import run_down, run_up
from tests.support.master_harness import free_port

# command → the key its document holds
LISTS = {
    ("devices",): "devices",
    ("events",): "events",
    ("reservation", "list"): "reservations",
    ("nodes",): "nodes",
    ("node", "list"): "nodes",
    ("sandbox", "list"): "sandboxes",
    ("template", "list"): "templates",
}


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cubeaccel", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **env},
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """An `up` stack; the CLI finds it through CUBEACCEL_UP_STATE_DIR only (no --master, no --state-dir)."""
    state = tmp_path_factory.mktemp("up")
    empty = tmp_path_factory.mktemp("no-cubelet")
    assert run_up(state, "simulated", "h100x2", detach=True) == 0
    env = {"CUBEACCEL_UP_STATE_DIR": str(state), "CUBEACCEL_STATE_DIR": str(empty)}
    env.pop("CUBEACCEL_MASTER", None)
    try:
        yield env
    finally:
        run_down(state)


@pytest.mark.parametrize("cmd", list(LISTS), ids=" ".join)
def test_list_commands_print_one_json_document(stack: dict[str, str], cmd: tuple[str, ...]) -> None:
    out = cli(stack, *cmd, "-o", "json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert isinstance(doc[LISTS[cmd]], list)
    as_yaml = cli(stack, "-o", "yaml", *cmd)  # before the command too
    assert as_yaml.returncode == 0 and isinstance(yaml.safe_load(as_yaml.stdout)[LISTS[cmd]], list)


def test_the_up_stack_is_found_and_ids_are_shown_in_full(stack: dict[str, str]) -> None:
    devices = json.loads(cli(stack, "devices", "-o", "json").stdout)["devices"]
    assert len(devices) == 2
    table = cli({**stack, "COLUMNS": "80"}, "devices").stdout
    for d in devices:
        assert d["id"] in table.replace("\n", "") or d["id"] in table  # never cut, even at 80 columns
    templates = json.loads(cli(stack, "template", "list", "-o", "json").stdout)
    assert templates["defaults"] == {"gpu": "cuda12-h100", "accelerator": "edu-demo"}


def test_node_drain_and_undrain_show_who_and_why(stack: dict[str, str]) -> None:
    out = cli(stack, "node", "drain", "local", "--reason", "kernel update")
    assert out.returncode == 0, out.stderr
    assert "draining" in out.stdout and "kernel update" in out.stdout and "by admin" in out.stdout
    nodes = json.loads(cli(stack, "nodes", "-o", "json").stdout)["nodes"]
    assert nodes[0]["state"] == "draining"
    back = json.loads(cli(stack, "node", "undrain", "local", "--reason", "done", "-o", "json").stdout)
    assert back["state"] == "ready"


@pytest.mark.parametrize("cmd", list(LISTS), ids=" ".join)
def test_with_the_server_down_the_error_is_one_json_document(tmp_path: Path, cmd: tuple[str, ...]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    env = {"CUBEACCEL_UP_STATE_DIR": str(tmp_path), "CUBEACCEL_STATE_DIR": str(tmp_path), "CUBEACCEL_MASTER": url}
    out = cli(env, *cmd, "-o", "json")
    assert out.returncode == 1
    err = json.loads(out.stdout)["error"]
    assert err["code"] == "cli.unreachable"
    assert url in err["message"] or str(tmp_path / "cubelet.sock") in err["message"]
    text = cli(env, *cmd)
    assert text.returncode == 1 and text.stdout == ""
    [line] = text.stderr.strip().splitlines()  # one line on stderr, no traceback
    assert "cannot reach" in line and "cubeaccel up" in line
