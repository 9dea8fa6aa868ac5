"""The CLI's output layer: where `-o` is taken, what an error looks like in each format, states by color."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import typer
from rich.console import Console

from cubeaccel.cli import output
from cubeaccel.cli.render import device_table
from cubeaccel.protocol.errors import CubeError


@pytest.fixture(autouse=True)
def table_format() -> Iterator[None]:
    yield
    output.set_format("table")


@pytest.mark.parametrize(
    ("argv", "rest", "fmt"),
    [
        (["devices", "-o", "json"], ["devices"], "json"),
        (["-o", "yaml", "nodes"], ["nodes"], "yaml"),
        (["sandbox", "list", "--output=json"], ["sandbox", "list"], "json"),
        (["devices", "-ojson"], ["devices"], "json"),
        (["sandbox", "exec", "sb", "--", "ls", "-o", "x"], ["sandbox", "exec", "sb", "--", "ls", "-o", "x"], "table"),
        (["sandbox", "exec", "sb", "ls", "-o", "x"], ["sandbox", "exec", "sb", "ls", "-o", "x"], "table"),
    ],
)
def test_o_is_taken_anywhere_before_the_command_of_exec(argv: list[str], rest: list[str], fmt: str) -> None:
    assert output.pop_output(argv) == rest
    assert output.output_format() == fmt


def test_a_json_invocation_does_not_turn_the_next_one_in_the_same_process_into_json() -> None:
    from typer.testing import CliRunner

    from cubeaccel.cli.root import app

    CliRunner().invoke(app, ["-o", "json", "--version"])
    output.set_format("json")  # as a `-o json` invocation leaves it
    CliRunner().invoke(app, ["host", "check", "--help"])
    assert output.output_format() == "table"


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(typer.BadParameter):
        output.pop_output(["devices", "-o", "xml"])


def test_under_json_an_error_is_the_one_document_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    output.set_format("json")
    with pytest.raises(typer.Exit) as done:
        output.fail(CubeError("device.not_found", "no device 'x'", "api"))
    assert done.value.exit_code == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["error"]["code"] == "device.not_found" and out.err == ""


def test_in_table_mode_an_unreachable_server_is_one_line_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    e = output.unreachable(
        "CubeMaster", "http://127.0.0.1:9", httpx.ConnectError("[Errno 111] Connection refused"), "fix it"
    )
    with pytest.raises(typer.Exit):
        output.fail(e)
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.strip().splitlines() == [
        "error cli.unreachable (layer api): cannot reach CubeMaster at http://127.0.0.1:9 (connection refused); fix it"
    ]


def test_quarantined_does_not_look_like_allocatable() -> None:
    styles = output.STATE_STYLES
    assert styles["quarantined"] != styles["allocatable"] and styles["unhealthy"] != styles["allocatable"]
    con = Console(force_terminal=True, color_system="truecolor", width=200, record=True)
    dev = {
        "id": "vfio-0000:10:00.0",
        "address": "0000:10:00.0",
        "labels": {"model": "H100"},
        "numa_node": 0,
        "sandbox_id": None,
        "reason": None,
    }
    con.print(device_table([{**dev, "state": "allocatable"}, {**dev, "state": "quarantined"}]))
    text = con.export_text(styles=True)
    allocatable = next(line for line in text.splitlines() if "allocatable" in line)
    quarantined = next(line for line in text.splitlines() if "quarantined" in line)
    assert allocatable.replace("allocatable", "") != quarantined.replace("quarantined", "")  # other escapes


def test_a_pipe_gets_a_wide_console_and_ids_are_never_cut() -> None:
    con = output.console()
    assert not con.is_terminal and con.width >= 200
    long_id = "emulated-0000:00:05.0-0123abcd"  # an emulated device's id, the longest kind
    dev = {
        "id": long_id,
        "address": "0000:00:05.0",
        "labels": {"model": "edu"},
        "numa_node": 0,
        "state": "quarantined",
        "sandbox_id": "sb-0123456789abcdef0123",
        "reason": "operator.quarantine",
    }
    narrow = Console(width=80, record=True, no_color=True)
    narrow.print(device_table([dev]))
    text = narrow.export_text()
    assert long_id in text and "0000:00:05.0" in text and "quarantined" in text  # never wrapped or cut


def test_version_and_shell_completion() -> None:
    import os
    import subprocess
    import sys

    import cubeaccel

    run = [sys.executable, "-m", "cubeaccel"]
    v = subprocess.run([*run, "--version"], capture_output=True, text=True, check=False)
    assert v.returncode == 0 and v.stdout == f"cubeaccel {cubeaccel.__version__}\n"
    env = {**os.environ, "COMP_WORDS": "cubeaccel node ", "COMP_CWORD": "2", "_CUBEACCEL_COMPLETE": "complete_bash"}
    words = subprocess.run(run, capture_output=True, text=True, env=env, check=False).stdout.split()
    assert {"list", "drain", "undrain"} <= set(words)
