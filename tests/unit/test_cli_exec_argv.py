"""`sandbox exec ID [OPTIONS] [--] CMD…`: exec's options after the sandbox id are exec's, not the command's; the
command is what follows `--` (or the first word after the id that is not an option), byte for byte."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from cubeaccel.cli import sandbox as cli_sandbox
from cubeaccel.cli.exec_argv import command_after_id


class Ran:
    exit_code = 0


class FakeWorkload:
    """Stands in for the sandbox's workload: records what exec asked to run."""

    def __init__(self, calls: list[dict[str, Any]]) -> None:
        self.calls = calls

    def exec(self, cmd: list[str], **kw: Any) -> Ran:
        self.calls.append({"cmd": cmd, **kw})
        return Ran()

    def close(self) -> None:
        pass


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    def workload(sid: str, url: str | None, token: str | None) -> FakeWorkload:
        seen.append({"sid": sid})
        return FakeWorkload(seen)

    monkeypatch.setattr(cli_sandbox, "_workload", workload)
    return seen


def run_exec(*argv: str) -> Any:
    return CliRunner().invoke(cli_sandbox.sandbox_app, ["exec", *argv], input="")


@pytest.mark.parametrize(
    ("argv", "cmd"),
    [
        (["sb-1", "--no-stdin", "--", "echo", "hi"], ["echo", "hi"]),
        (["--no-stdin", "sb-1", "--", "echo", "hi"], ["echo", "hi"]),
        (["sb-1", "--cwd", "/tmp", "--env=A=1", "--no-stdin", "ls", "-la"], ["ls", "-la"]),
        (["sb-1", "ls", "--no-stdin"], ["ls", "--no-stdin"]),  # after the command's first word: the command's
        (["sb-1", "--", "--no-stdin"], ["--no-stdin"]),
        (["sb-1", "--", "sh", "-c", "echo -- x"], ["sh", "-c", "echo -- x"]),
    ],
)
def test_options_after_the_sandbox_id_are_execs_and_the_command_is_what_follows(
    calls: list[dict[str, Any]], argv: list[str], cmd: list[str]
) -> None:
    r = run_exec(*argv)
    assert r.exit_code == 0, r.output
    sid, ran = calls
    assert sid == {"sid": "sb-1"} and ran["cmd"] == cmd


def test_no_stdin_after_the_id_is_honoured(calls: list[dict[str, Any]]) -> None:
    r = run_exec("sb-1", "--cwd", "/w", "--no-stdin", "--", "cat")
    assert r.exit_code == 0, r.output
    assert (calls[1]["cmd"], calls[1]["stdin"], calls[1]["cwd"]) == (["cat"], None, "/w")


def test_an_unknown_option_after_the_id_is_refused_not_run(calls: list[dict[str, Any]]) -> None:
    r = run_exec("sb-1", "--no-stdn", "--", "rm", "-rf", "/tmp/x")
    assert r.exit_code == 2 and "--no-stdn" in r.output
    assert calls == []


def test_a_missing_command_is_refused(calls: list[dict[str, Any]]) -> None:
    r = run_exec("sb-1", "--no-stdin", "--")
    assert r.exit_code == 2 and "no command" in r.output
    assert calls == []


VALUE = {"--env", "--cwd", "--user", "--timeout", "--token", "--master"}
FLAG = {"--no-stdin", "--help"}
words = st.text(alphabet="abc-=/ ", min_size=1, max_size=6)
options = st.lists(
    st.one_of(
        st.sampled_from(sorted(FLAG - {"--help"})).map(lambda f: [f]),
        st.tuples(st.sampled_from(sorted(VALUE)), words).map(list),
        st.tuples(st.sampled_from(sorted(VALUE)), words).map(lambda t: [f"{t[0]}={t[1]}"]),
    ),
    max_size=4,
).map(lambda groups: [w for g in groups for w in g])


@given(before=options, after=options, cmd=st.lists(words, min_size=1, max_size=5))
def test_the_command_after_dashes_is_kept_whatever_options_surround_the_id(
    before: list[str], after: list[str], cmd: list[str]
) -> None:
    out = command_after_id([*before, "sb", *after, "--", *cmd], VALUE, FLAG)
    assert out == [*before, *after, "sb", "--", *cmd]


@given(cmd=st.lists(words, min_size=1, max_size=5).filter(lambda c: not c[0].startswith("-")))
def test_a_command_without_dashes_starts_at_its_first_plain_word(cmd: list[str]) -> None:
    assert command_after_id(["--no-stdin", "sb", *cmd], VALUE, FLAG) == ["--no-stdin", "sb", "--", *cmd]


def test_an_unknown_dash_word_after_the_id_raises() -> None:
    with pytest.raises(typer.BadParameter):
        command_after_id(["sb", "-x", "ls"], VALUE, FLAG)
