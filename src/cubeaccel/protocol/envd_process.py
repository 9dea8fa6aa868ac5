"""envd's process service messages (e2b-dev/infra packages/envd/spec/process/process.proto) as both ends hold
them: the guest's workload service decodes requests into these and encodes its replies and events from them; the
host's workload client encodes its requests and decodes the events it reads. The filesystem service's messages are
in `envd_filesystem.py`, both read and written as `proto_json.py` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cubeaccel.protocol import proto_json as pj
from cubeaccel.protocol.proto_json import Json

SIGNALS = {"SIGNAL_UNSPECIFIED": 0, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9}


@dataclass(frozen=True)
class ProcessConfig:
    """`args`/`envs` None: absent (the guest lists a command's config with them only when given non-empty; the
    host's client always sends `args`)."""

    cmd: str
    args: tuple[str, ...] | None = None
    envs: dict[str, str] | None = None
    cwd: str | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"cmd": self.cmd}
        if self.args is not None:
            out["args"] = list(self.args)
        if self.envs is not None:
            out["envs"] = dict(self.envs)
        if self.cwd is not None:
            out["cwd"] = self.cwd
        return out

    @classmethod
    def from_json(cls, msg: Json) -> ProcessConfig:
        cmd = pj.get_str(msg, "cmd")
        args = None if pj.get(msg, "args") is None else tuple(pj.get_str_list(msg, "args"))
        envs = None if pj.get(msg, "envs") is None else pj.get_str_map(msg, "envs")
        return cls(cmd, args, envs, pj.get_opt_str(msg, "cwd"))


@dataclass(frozen=True)
class PtySize:
    cols: int = 0
    rows: int = 0

    def to_json(self) -> dict[str, object]:
        return {k: v for k, v in (("cols", self.cols), ("rows", self.rows)) if v}

    @classmethod
    def from_json(cls, msg: Json) -> PtySize:
        return cls(pj.get_uint32(msg, "cols"), pj.get_uint32(msg, "rows"))


@dataclass(frozen=True)
class Pty:
    size: PtySize = PtySize()

    def to_json(self) -> dict[str, object]:
        return {"size": self.size.to_json()}

    @classmethod
    def from_json(cls, msg: Json) -> Pty:
        return cls(PtySize.from_json(pj.get_obj(msg, "size") or {}))


def _pty(msg: Json) -> Pty | None:
    obj = pj.get_obj(msg, "pty")
    return None if obj is None else Pty.from_json(obj)


@dataclass(frozen=True)
class ProcessSelector:
    """By pid, else by tag; neither set is a request without a selector (the service refuses it)."""

    pid: int | None = None
    tag: str | None = None

    def to_json(self) -> dict[str, object]:
        if self.pid is not None:
            return {"pid": self.pid}
        return {} if self.tag is None else {"tag": self.tag}

    @classmethod
    def from_json(cls, msg: Json) -> ProcessSelector:
        tag = pj.get_opt_str(msg, "tag")
        pid = None if pj.get(msg, "pid") is None else pj.get_uint32(msg, "pid")
        return cls(pid, tag)


def _selector(msg: Json, name: str = "process") -> ProcessSelector | None:
    obj = pj.get_obj(msg, name)
    return None if obj is None else ProcessSelector.from_json(obj)


def _with(out: dict[str, object], name: str, value: ProcessSelector | ProcessInput | Pty | None) -> None:
    if value is not None:
        out[name] = value.to_json()


@dataclass(frozen=True)
class StartRequest:
    """`stdin` None: absent, which envd reads as true."""

    process: ProcessConfig
    pty: Pty | None = None
    tag: str | None = None
    stdin: bool | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"process": self.process.to_json()}
        _with(out, "pty", self.pty)
        if self.tag is not None:
            out["tag"] = self.tag
        if self.stdin is not None:
            out["stdin"] = self.stdin
        return out

    @classmethod
    def from_json(cls, msg: Json) -> StartRequest:
        process = ProcessConfig.from_json(pj.get_obj(msg, "process") or {})
        return cls(process, _pty(msg), pj.get_opt_str(msg, "tag"), pj.get_opt_bool(msg, "stdin"))


@dataclass(frozen=True)
class ProcessRequest:
    """ConnectRequest and CloseStdinRequest: a process and nothing else."""

    process: ProcessSelector | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {}
        _with(out, "process", self.process)
        return out

    @classmethod
    def from_json(cls, msg: Json) -> ProcessRequest:
        return cls(_selector(msg))


@dataclass(frozen=True)
class ProcessInput:
    """A oneof: `pty` is read first, as the service has always done; neither set is refused by the service."""

    stdin: bytes | None = None
    pty: bytes | None = None

    def to_json(self) -> dict[str, object]:
        if self.pty is not None:
            return {"pty": pj.b64(self.pty)}
        return {} if self.stdin is None else {"stdin": pj.b64(self.stdin)}

    @classmethod
    def from_json(cls, msg: Json) -> ProcessInput:
        pty = pj.get_bytes(msg, "pty")
        if pty is not None:
            return cls(pty=pty)
        return cls(stdin=pj.get_bytes(msg, "stdin"))


def _input(msg: Json) -> ProcessInput | None:
    obj = pj.get_obj(msg, "input")
    return None if obj is None else ProcessInput.from_json(obj)


@dataclass(frozen=True)
class SendInputRequest:
    process: ProcessSelector | None = None
    input: ProcessInput | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {}
        _with(out, "process", self.process)
        _with(out, "input", self.input)
        return out

    @classmethod
    def from_json(cls, msg: Json) -> SendInputRequest:
        return cls(_selector(msg), _input(msg))


@dataclass(frozen=True)
class SendSignalRequest:
    """`signal`: the enum's number (`SIGNALS`), written by name."""

    process: ProcessSelector | None = None
    signal: int = 0

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {}
        _with(out, "process", self.process)
        if self.signal:
            names = {v: k for k, v in SIGNALS.items()}
            out["signal"] = names.get(self.signal, self.signal)
        return out

    @classmethod
    def from_json(cls, msg: Json) -> SendSignalRequest:
        return cls(_selector(msg), pj.get_enum(msg, "signal", SIGNALS))


@dataclass(frozen=True)
class UpdateRequest:
    process: ProcessSelector | None = None
    pty: Pty | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {}
        _with(out, "process", self.process)
        _with(out, "pty", self.pty)
        return out

    @classmethod
    def from_json(cls, msg: Json) -> UpdateRequest:
        return cls(_selector(msg), _pty(msg))


@dataclass(frozen=True)
class StreamInputRequest:
    """One envelope of StreamInput: `start{process}`, `data{input}` or `keepalive{}` (a oneof); `kind` None:
    none of them (the service refuses it)."""

    kind: Literal["start", "data", "keepalive"] | None
    process: ProcessSelector | None = None
    input: ProcessInput | None = None

    def to_json(self) -> dict[str, object]:
        body: dict[str, object] = {}
        if self.kind == "start":
            _with(body, "process", self.process)
        elif self.kind == "data":
            _with(body, "input", self.input)
        return {} if self.kind is None else {self.kind: body}

    @classmethod
    def from_json(cls, msg: Json) -> StreamInputRequest:
        if (start := pj.get_obj(msg, "start")) is not None:
            return cls("start", process=_selector(start))
        if (data := pj.get_obj(msg, "data")) is not None:
            return cls("data", input=_input(data))
        return cls("keepalive" if pj.get_obj(msg, "keepalive") is not None else None)


@dataclass(frozen=True)
class StartEvent:
    pid: int

    def to_json(self) -> dict[str, object]:
        return {"pid": self.pid}

    @classmethod
    def from_json(cls, msg: Json) -> StartEvent:
        return cls(pj.get_uint32(msg, "pid"))


@dataclass(frozen=True)
class DataEvent:
    """Output: one of `stdout`, `stderr`, `pty` (a oneof; the service writes one per event)."""

    stream: Literal["stdout", "stderr", "pty"]
    data: bytes

    def to_json(self) -> dict[str, object]:
        return {self.stream: pj.b64(self.data)}

    @classmethod
    def from_json(cls, msg: Json) -> DataEvent:
        for stream in ("stdout", "stderr", "pty"):
            data = pj.get_bytes(msg, stream)
            if data is not None:
                return cls(stream, data)
        raise pj.ProtoJsonError("data must have stdout, stderr or pty")


@dataclass(frozen=True)
class EndEvent:
    """As envd fills it from Go's ProcessState: `status` and `error` are Go's strings (`exit status 3`,
    `signal: killed`), `exit_code` is -1 after a signal."""

    exit_code: int = 0
    exited: bool = False
    status: str = ""
    error: str | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.exited:  # key order as the service has always written it
            out["exited"] = True
            if self.status:
                out["status"] = self.status
        if self.exit_code:
            out["exitCode"] = self.exit_code
        if self.status and not self.exited:
            out["status"] = self.status
        if self.error is not None:
            out["error"] = self.error
        return out

    @classmethod
    def from_json(cls, msg: Json) -> EndEvent:
        return cls(
            pj.get_int32(msg, "exit_code"),
            pj.get_bool(msg, "exited"),
            pj.get_str(msg, "status"),
            pj.get_opt_str(msg, "error"),
        )


@dataclass(frozen=True)
class KeepAlive:
    def to_json(self) -> dict[str, object]:
        return {}

    @classmethod
    def from_json(cls, msg: Json) -> KeepAlive:
        return cls()


ProcessEventBody = StartEvent | DataEvent | EndEvent | KeepAlive
_EVENT_KINDS: tuple[tuple[str, type[ProcessEventBody]], ...] = (
    ("start", StartEvent),
    ("data", DataEvent),
    ("end", EndEvent),
    ("keepalive", KeepAlive),
)


@dataclass(frozen=True)
class ProcessEvent:
    """StartResponse and ConnectResponse: `{"event": {<kind>: …}}`; `event` None: an event of a kind we do not
    know (a newer envd's), which a reader skips."""

    event: ProcessEventBody | None

    def to_json(self) -> dict[str, object]:
        if self.event is None:
            return {"event": {}}
        kind = next(k for k, t in _EVENT_KINDS if isinstance(self.event, t))
        return {"event": {kind: self.event.to_json()}}

    @classmethod
    def from_json(cls, msg: Json) -> ProcessEvent:
        event = pj.get_obj(msg, "event") or {}
        for kind, t in _EVENT_KINDS:
            body = pj.get_obj(event, kind)
            if body is not None:
                return cls(t.from_json(body))
        return cls(None)


@dataclass(frozen=True)
class ProcessInfo:
    config: ProcessConfig
    pid: int
    tag: str | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"config": self.config.to_json(), "pid": self.pid}
        if self.tag is not None:
            out["tag"] = self.tag
        return out

    @classmethod
    def from_json(cls, msg: Json) -> ProcessInfo:
        config = ProcessConfig.from_json(pj.get_obj(msg, "config") or {})
        return cls(config, pj.get_uint32(msg, "pid"), pj.get_opt_str(msg, "tag"))


@dataclass(frozen=True)
class ListResponse:
    processes: tuple[ProcessInfo, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"processes": [p.to_json() for p in self.processes]} if self.processes else {}

    @classmethod
    def from_json(cls, msg: Json) -> ListResponse:
        return cls(tuple(ProcessInfo.from_json(p) for p in pj.get_objs(msg, "processes")))
