"""How every command speaks: `-o table|json|yaml`, errors on stderr (or as one JSON document), terminal widths.

Under `-o json` (or yaml) stdout carries exactly one document — the result, or `{"error": {...}}` when the command
fails — so `cubeaccel devices -o json | jq` parses whatever happened; the exit status says which it was. In table
mode results go to stdout and errors to stderr as one line naming the code, the layer and, for a server that is
down, the URL or socket tried and how to start it. No traceback reaches a user for an expected failure.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import httpx
import typer
from pydantic_core import to_jsonable_python
from rich.console import Console
from rich.text import Text

from cubeaccel.model.sandbox_states import NodeState, SandboxState
from cubeaccel.model.states import DeviceState
from cubeaccel.protocol.errors import CubeError

FORMATS = ("table", "json", "yaml")
_format = {"value": "table", "from_argv": ""}  # from_argv: set by pop_output for this process

# States by what an operator should notice: handed-out-able green, busy cyan, out of service red. Keyed by the
# machines' own states (device, sandbox, node), so a renamed state cannot silently lose its colour.
D, SS, N = DeviceState, SandboxState, NodeState
STATE_STYLES: dict[str, str] = {
    D.ALLOCATABLE: "green",
    N.READY: "green",
    SS.RUNNING: "green",
    D.INITIALIZED: "blue",
    D.RESERVED: "cyan",
    D.PREPARING: "cyan",
    D.ATTACHED: "cyan",
    SS.SCHEDULING: "cyan",
    SS.PLACING: "cyan",
    SS.STARTING: "cyan",
    D.RELEASING: "yellow",
    D.RELEASED: "yellow",
    N.DRAINING: "yellow",
    SS.DELETING: "yellow",
    "stale": "yellow",  # a node's, derived (never stored)
    D.QUARANTINED: "bold white on red",
    D.UNHEALTHY: "bold red",
    SS.FAILED: "bold red",
    SS.LOST: "bold red",
    D.DISABLED: "dim",
    SS.DELETED: "dim",
}


ONE_LINE = {
    "cli.unreachable",
    "state.locked",
    "config.invalid",
}  # their message names everything; details only under -o json


def set_format(value: str, from_argv: bool = False) -> None:
    if value not in FORMATS:
        raise typer.BadParameter(f"-o must be one of {', '.join(FORMATS)}, not {value!r}")
    _format["value"] = value
    _format["from_argv"] = "yes" if from_argv else ""


def set_format_of_invocation(value: str) -> None:
    """The root command's `-o`: what this invocation asked for, else what `pop_output` found on the command line,
    else a table. Never the last invocation's choice: one process may run many (a test's CliRunner)."""
    if value != "table" or not _format["from_argv"]:
        set_format(value)


def output_format() -> str:
    return _format["value"]


def machine() -> bool:
    """A machine-readable format: no tables, no progress, no colors on stdout."""
    return _format["value"] != "table"


def console(stderr: bool = False) -> Console:
    """The terminal's own width; a pipe or a log gets a wide one so ids and reasons are never cut."""
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=240, no_color=True)


def state(value: str | None) -> Text:
    return Text(value or "-", style=STATE_STYLES.get(value or "", ""))


def emit(data: Any, render: Callable[[], None] | None = None) -> None:
    """The result: JSON/YAML of `data` under -o json|yaml, else `render()` (default: pretty JSON)."""
    fmt = _format["value"]
    data = to_jsonable_python(data, by_alias=True, fallback=str)  # wire models as their JSON
    if fmt == "json" or (fmt == "table" and render is None):
        print(json.dumps(data, indent=2, default=str))
    elif fmt == "yaml":
        import yaml

        print(yaml.safe_dump(data, sort_keys=False), end="")
    else:
        assert render is not None
        render()


def fail(e: CubeError, exit_code: int = 1) -> NoReturn:
    if machine():
        emit(e.to_json())
    else:
        err = console(stderr=True)
        err.print(Text.assemble(("error ", "bold red"), f"{e.code} (layer {e.layer}): {e.message}"), soft_wrap=True)
        shown = {k: v for k, v in e.details.items() if k not in ("url", "socket", "cause")}
        if shown and e.code not in ONE_LINE:
            err.print_json(json.dumps(shown, default=str))
    raise typer.Exit(exit_code)


def unreachable(what: str, where: str, cause: BaseException, fix: str) -> CubeError:
    """One line: what could not be reached, where, why (the OS's words, not a traceback), and the fix."""
    reason = str(cause).strip() or type(cause).__name__
    if isinstance(cause, httpx.ConnectError | ConnectionRefusedError) and "refused" in reason.lower():
        reason = "connection refused"
    elif isinstance(cause, FileNotFoundError) or "No such file" in reason:
        reason = "no such socket"
    return CubeError(
        "cli.unreachable",
        f"cannot reach {what} at {where} ({reason}); {fix}",
        "api",
        {"url" if "://" in where else "socket": where, "cause": reason},
    )


@contextmanager
def reaching(what: str, where: str, fix: str) -> Iterator[None]:
    """Transport failures inside the block become `cli.unreachable`; CubeErrors become the one-line error."""
    try:
        yield
    except CubeError as e:
        fail(e)
    except (httpx.TransportError, OSError) as e:
        fail(unreachable(what, where, e, fix))


def pop_output(argv: list[str]) -> list[str]:
    """`-o FMT` / `--output FMT` / `--output=FMT` anywhere before `--` (so every command takes it, whatever
    its author declared); `--json` stays each command's own alias. `sandbox exec`'s command is left alone."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--" or a == "exec":
            out += argv[i:]
            break
        if a in ("-o", "--output") and i + 1 < len(argv):
            set_format(argv[i + 1], from_argv=True)
            i += 2
            continue
        if a.startswith("--output="):
            set_format(a.split("=", 1)[1], from_argv=True)
        elif a.startswith("-o") and len(a) > 2 and not a.startswith("--"):
            set_format(a[2:], from_argv=True)
        else:
            out.append(a)
        i += 1
    return out


def json_flag(as_json: bool) -> None:
    """Commands' historical `--json` flag: the same as `-o json`."""
    if as_json:
        set_format("json")


class Progress:
    """Live phases of long work on a terminal (stderr, so stdout stays the result): a spinner on the current phase,
    a line with its duration when it ends. Silent under -o json|yaml and when stderr is not a terminal."""

    def __init__(self, title: str) -> None:
        import time

        self._clock = time.monotonic
        self._con = Console(stderr=True)
        self._on = not machine() and self._con.is_terminal
        self._title = title
        self._status: Any = None
        self._phase: str | None = None
        self._t0 = self._start = self._clock()

    def __enter__(self) -> Progress:
        if self._on:
            self._status = self._con.status(self._title)
            self._status.__enter__()
        return self

    def phase(self, text: str) -> None:
        """Begin the phase `text`; an empty `text` ends the display (the work goes on quietly)."""
        self._done()
        self._phase, self._t0 = text or None, self._clock()
        if not text:
            self.__exit__(None, None, None)
            self._on, self._status = False, None
        elif self._status is not None:
            self._status.update(f"{self._title}: {text}")

    def _done(self) -> None:
        if self._on and self._phase is not None:
            self._con.print(f"  [green]✓[/] {self._phase} [dim]{self._clock() - self._t0:.1f}s[/]")

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self._done()
        if self._status is not None:
            self._status.__exit__(*exc)
            if exc[0] is None:
                self._con.print(f"[bold]{self._title}[/]: done in {self._clock() - self._start:.1f}s")
