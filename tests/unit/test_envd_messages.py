"""envd's messages as both ends hold them (protocol/envd_process.py, envd_filesystem.py): each round-trips through
its JSON; the JSON is byte-for-byte what the service and the host's client wrote before they were typed (the
`_old_*` functions are that code, kept here as the oracle); a request decoder fed any JSON answers a Connect
error, never a crash."""

from __future__ import annotations

import base64
import json
import os
import signal
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cubeaccel.protocol import envd_filesystem as f
from cubeaccel.protocol import envd_process as m
from cubeaccel.protocol import proto_json as pj
from cubeaccel.protocol.connect_envelope import encode_json
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.guest_metrics import MetricsSample, MetricsSeries, PciFunction
from cubeaccel.transport.workload_client import WorkloadClient as HostClient
from cubeaccel.wire.e2b_api import GuestMetrics
from cubeaccel.workload import connect as c
from cubeaccel.workload import files as fs
from cubeaccel.workload.process import SIGNAL_NAMES, end_event
from cubeaccel.workload.users import owner_names
from tests.workload_client import ServerProcess, workload_server


def dumps(doc: object) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


# ---- the code before the messages were typed ------------------------------------------------------------------


def _old_end_event(returncode: int) -> dict[str, Any]:
    if returncode >= 0:
        status = f"exit status {returncode}"
        end: dict[str, Any] = {"exited": True, "status": status}
        if returncode:
            end["exitCode"] = returncode
            end["error"] = status
        return end
    signum = -returncode
    status = f"signal: {SIGNAL_NAMES.get(signum, f'signal {signum}')}"
    return {"exitCode": -1, "status": status, "error": status}


def _old_entry_info(path: str) -> dict[str, Any]:
    st_ = os.lstat(path)
    entry: dict[str, Any] = {"name": os.path.basename(path.rstrip("/")) or "/"}
    kind, mode = fs._kind(st_.st_mode), stat.S_IMODE(st_.st_mode) & 0o777
    target: str | None = None
    if stat.S_ISLNK(st_.st_mode):
        try:
            target = os.path.realpath(path, strict=True)
            tst = os.stat(target)
            kind, mode = fs._kind(tst.st_mode), stat.S_IMODE(tst.st_mode) & 0o777
        except OSError:
            target = target or path
            kind, mode = None, 0
    if kind:
        entry["type"] = kind
    entry["path"] = path
    if st_.st_size:
        entry["size"] = str(st_.st_size)
    if mode:
        entry["mode"] = mode
    entry["permissions"] = fs.go_mode_string(st_.st_mode)
    entry["owner"], entry["group"] = owner_names(st_.st_uid, st_.st_gid)
    entry["modifiedTime"] = fs.timestamp(st_.st_mtime_ns)
    if target is not None:
        entry["symlinkTarget"] = target
    metadata = fs.read_metadata(path)
    if metadata:
        entry["metadata"] = metadata
    return entry


def _old_shown(cmd: str, args: list[str], envs: dict[str, str], cwd_in: str | None) -> dict[str, Any]:
    shown: dict[str, Any] = {"cmd": cmd}
    if args:
        shown["args"] = args
    if envs:
        shown["envs"] = envs
    if cwd_in is not None:
        shown["cwd"] = cwd_in
    return shown


def _old_start_request(cmd: list[str], envs: dict[str, str] | None, cwd: str | None, stdin: bool) -> bytes:
    process: dict[str, Any] = {"cmd": cmd[0], "args": cmd[1:]}
    if envs:
        process["envs"] = envs
    if cwd:
        process["cwd"] = cwd
    return encode_json({"process": process, "stdin": stdin})


# ---- byte-for-byte ------------------------------------------------------------------------------------------


def test_end_events_are_written_as_before() -> None:
    for rc in [*range(-65, 300), 2**31 - 1]:
        assert dumps(end_event(rc).to_json()) == dumps(_old_end_event(rc)), rc
        assert m.EndEvent.from_json(_old_end_event(rc)) == end_event(rc)


def test_entries_are_written_as_before(tmp_path: Path) -> None:
    (tmp_path / "empty").touch()
    (tmp_path / "data").write_bytes(b"x" * 70000)
    (tmp_path / "data").chmod(0o4751)
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "data")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(tmp_path / "fifo")
    os.utime(tmp_path / "data", ns=(0, 1_700_000_000_123_456_789))
    paths = [str(p) for p in sorted(tmp_path.iterdir())] + [str(tmp_path), "/"]
    for path in paths:
        assert dumps(fs.entry_info(path).to_json()) == dumps(_old_entry_info(path)), path
        assert f.EntryInfo.from_json(_old_entry_info(path)) == fs.entry_info(path)
    listed = fs.list_dir(str(tmp_path) + "/./", 2)
    assert [e.path for e in listed.entries] == [
        str(tmp_path) + "/./" + n for n in ("dangling", "data", "dir", "empty", "fifo", "link")
    ]
    assert dumps(fs.remove(str(tmp_path / "nothing")).to_json()) == b"{}"


names = st.text(max_size=12)
str_maps = st.dictionaries(names, names, max_size=3)


@given(names, st.lists(names, max_size=4), str_maps, st.none() | names, st.none() | names, st.integers(1, 2**32 - 1))
def test_the_guest_lists_a_command_as_before(
    cmd: str, args: list[str], envs: dict[str, str], cwd: str | None, tag: str | None, pid: int
) -> None:
    shown = m.ProcessConfig(cmd, tuple(args) or None, envs or None, cwd)  # as process.py builds it
    assert dumps(shown.to_json()) == dumps(_old_shown(cmd, args, envs, cwd))
    old_info: dict[str, Any] = {"config": _old_shown(cmd, args, envs, cwd), "pid": pid}
    if tag is not None:
        old_info["tag"] = tag
    assert dumps(m.ListResponse((m.ProcessInfo(shown, pid, tag),)).to_json()) == dumps({"processes": [old_info]})
    assert m.ListResponse().to_json() == {}


@given(st.integers(1, 2**32 - 1), st.sampled_from(["stdout", "stderr", "pty"]), st.binary(max_size=64))
def test_the_guest_writes_process_events_as_before(pid: int, kind: str, data: bytes) -> None:
    stream: Any = kind
    assert dumps(m.ProcessEvent(m.StartEvent(pid)).to_json()) == dumps({"event": {"start": {"pid": pid}}})
    old_data = {"event": {"data": {kind: base64.b64encode(data).decode("ascii")}}}
    assert dumps(m.ProcessEvent(m.DataEvent(stream, data)).to_json()) == dumps(old_data)
    assert dumps(m.ProcessEvent(m.KeepAlive()).to_json()) == b'{"event":{"keepalive":{}}}'
    assert dumps(m.ProcessEvent(end_event(-9)).to_json()) == dumps({"event": {"end": _old_end_event(-9)}})
    assert dumps(f.WatchDirResponse("start").to_json()) == b'{"start":{}}'
    assert dumps(f.WatchDirResponse("keepalive").to_json()) == b'{"keepalive":{}}'
    event = f.FilesystemEvent("a/b", "EVENT_TYPE_CREATE")
    old_event = {"filesystem": {"name": "a/b", "type": "EVENT_TYPE_CREATE"}}
    assert dumps(f.WatchDirResponse("filesystem", event).to_json()) == dumps(old_event)
    assert dumps(f.CreateWatcherResponse("w01").to_json()) == b'{"watcherId":"w01"}'
    assert f.GetWatcherEventsResponse().to_json() == {}


def test_upload_entries_are_written_as_before() -> None:
    plain = f.UploadedEntry("/h/a.txt", "a.txt").to_json()
    assert dumps(plain) == b'{"path":"/h/a.txt","name":"a.txt","type":"file"}'
    with_metadata = f.UploadedEntry("/a", "a", {"k": "v"}).to_json()
    assert dumps(with_metadata) == b'{"path":"/a","name":"a","type":"file","metadata":{"k":"v"}}'


@given(
    st.lists(names, min_size=1, max_size=4),
    st.none() | str_maps,
    st.none() | names,
    st.booleans(),
    st.integers(1, 2**32 - 1),
    st.binary(max_size=64),
)
def test_the_host_client_writes_requests_as_before(
    cmd: list[str], envs: dict[str, str] | None, cwd: str | None, stdin: bool, pid: int, chunk: bytes
) -> None:
    new = m.StartRequest(m.ProcessConfig(cmd[0], tuple(cmd[1:]), envs or None, cwd or None), stdin=stdin)
    assert encode_json(new.to_json()) == _old_start_request(cmd, envs, cwd, stdin)
    data = base64.b64encode(chunk).decode()
    old_input = {"process": {"pid": pid}, "input": {"stdin": data}}
    new_input = m.SendInputRequest(m.ProcessSelector(pid), m.ProcessInput(stdin=chunk))
    assert json.dumps(new_input.to_json()) == json.dumps(old_input)  # the client's unary JSON
    assert json.dumps(m.ProcessRequest(m.ProcessSelector(pid)).to_json()) == json.dumps({"process": {"pid": pid}})


# ---- round trips --------------------------------------------------------------------------------------------

uint32 = st.integers(0, 2**32 - 1)
selectors = st.builds(m.ProcessSelector, pid=uint32) | st.builds(m.ProcessSelector, tag=names)
inputs = st.builds(m.ProcessInput, stdin=st.binary(max_size=16)) | st.builds(m.ProcessInput, pty=st.binary(max_size=16))
ptys = st.builds(m.Pty, st.builds(m.PtySize, uint32, uint32))
configs = st.builds(
    m.ProcessConfig,
    names,
    st.none() | st.lists(names, max_size=3).map(tuple),
    st.none() | str_maps,
    st.none() | names,
)
entries = st.builds(
    f.EntryInfo,
    name=names,
    path=names,
    type=st.none() | st.sampled_from(f.FILE_TYPES),
    size=st.integers(0, 2**63 - 1),
    mode=st.integers(0, 0o7777),
    permissions=names,
    owner=names,
    group=names,
    modified_time=names,
    symlink_target=st.none() | names,
    metadata=str_maps,
)
fs_events = st.builds(f.FilesystemEvent, names, names, st.none() | entries)
end_events = st.builds(m.EndEvent, st.integers(-(2**31), 2**31 - 1), st.booleans(), names, st.none() | names)
process_events = st.builds(
    m.ProcessEvent,
    st.none()
    | st.builds(m.StartEvent, uint32)
    | st.builds(m.DataEvent, st.sampled_from(["stdout", "stderr", "pty"]), st.binary(max_size=16))
    | end_events
    | st.just(m.KeepAlive()),
)
MESSAGES: list[st.SearchStrategy[Any]] = [
    st.just(pj.Empty()),
    st.builds(m.StartRequest, configs, st.none() | ptys, st.none() | names, st.none() | st.booleans()),
    st.builds(m.ProcessRequest, st.none() | selectors),
    st.builds(m.SendInputRequest, st.none() | selectors, st.none() | inputs),
    st.builds(m.SendSignalRequest, st.none() | selectors, st.sampled_from([0, 9, 15]) | st.integers(-99, 99)),
    st.builds(m.UpdateRequest, st.none() | selectors, st.none() | ptys),
    st.builds(m.StreamInputRequest, st.just("start"), process=st.none() | selectors)
    | st.builds(m.StreamInputRequest, st.just("data"), input=st.none() | inputs)
    | st.builds(m.StreamInputRequest, st.sampled_from(["keepalive", None])),
    process_events,
    st.builds(m.ListResponse, st.lists(st.builds(m.ProcessInfo, configs, uint32, st.none() | names)).map(tuple)),
    entries,
    st.builds(f.PathRequest, names),
    st.builds(f.ListDirRequest, names, uint32),
    st.builds(f.MoveRequest, names, names),
    st.builds(f.WatchRequest, names, st.booleans(), st.booleans(), st.booleans()),
    st.builds(f.WatcherRequest, names),
    st.builds(f.EntryResponse, entries),
    st.builds(f.ListDirResponse, st.lists(entries, max_size=3).map(tuple)),
    st.builds(f.WatchDirResponse, st.sampled_from(["start", "keepalive"]))
    | st.builds(f.WatchDirResponse, st.just("filesystem"), fs_events),
    st.builds(f.CreateWatcherResponse, names),
    st.builds(f.GetWatcherEventsResponse, st.lists(fs_events, max_size=3).map(tuple)),
    st.builds(f.UploadedEntry, names, names, str_maps),
]


@pytest.mark.parametrize("strategy", MESSAGES, ids=lambda s: repr(s)[:40])
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_round_trips(strategy: st.SearchStrategy[Any], data: st.DataObject) -> None:
    message = data.draw(strategy)
    wire = json.loads(json.dumps(message.to_json()))
    assert type(message).from_json(wire) == message


def test_snake_case_null_and_string_numbers_are_read_as_protojson_reads_them() -> None:
    request = m.StartRequest.from_json(
        {"process": {"cmd": "ls", "args": None, "cwd": None}, "pty": {"size": {"cols": "80", "rows": 24.0}}}
    )
    assert request == m.StartRequest(m.ProcessConfig("ls"), m.Pty(m.PtySize(80, 24)))
    assert f.WatchRequest.from_json({"include_entry": True, "allowNetworkMounts": True}) == f.WatchRequest(
        "", False, True, True
    )
    assert m.SendSignalRequest.from_json({"signal": "SIGNAL_SIGKILL"}).signal == 9
    assert m.ProcessInput.from_json({"pty": "_-8", "stdin": "!!"}) == m.ProcessInput(pty=b"\xff\xef")  # oneof


# ---- decoders fed anything ----------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=24,
)
FIELDS = ["process", "pid", "tag", "input", "stdin", "pty", "size", "cols", "rows", "signal", "cmd", "args", "envs"]
FIELDS += ["cwd", "start", "data", "keepalive", "event", "end", "exitCode", "path", "depth", "watcherId", "entry"]
objects = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=6)
nested = st.recursive(objects, lambda inner: st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4), max_leaves=8)
DECODERS: list[Callable[[pj.Json], object]] = [
    pj.Empty.from_json,
    m.ProcessEvent.from_json,
    m.ListResponse.from_json,
    f.ListDirResponse.from_json,
    m.StartRequest.from_json,
    m.ProcessRequest.from_json,
    m.SendInputRequest.from_json,
    m.SendSignalRequest.from_json,
    m.UpdateRequest.from_json,
    m.StreamInputRequest.from_json,
    f.PathRequest.from_json,
    f.ListDirRequest.from_json,
    f.MoveRequest.from_json,
    f.WatchRequest.from_json,
    f.WatcherRequest.from_json,
    f.EntryResponse.from_json,
    f.WatchDirResponse.from_json,
    f.GetWatcherEventsResponse.from_json,
    f.UploadedEntry.from_json,
]


@settings(max_examples=300)
@given(nested | objects)
def test_decoders_fed_any_json_refuse_it_by_field_or_read_it(doc: dict[str, Any]) -> None:
    for decode in DECODERS:
        try:
            decode(doc)
        except pj.ProtoJsonError as e:
            assert str(e)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with workload_server(tmp_path_factory.mktemp("workload")) as srv:
        yield srv


SAFE_UNARY = [  # calls that change nothing for a request that names no process of ours or no file
    "process.Process/List",
    "process.Process/SendInput",
    "process.Process/CloseStdin",
    "process.Process/Update",
    "process.Process/SendSignal",
    "filesystem.Filesystem/GetWatcherEvents",
    "filesystem.Filesystem/RemoveWatcher",
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nested | objects, st.sampled_from(SAFE_UNARY))
def test_the_service_answers_any_request_json_with_a_connect_error(
    server: ServerProcess, doc: dict[str, Any], method: str
) -> None:
    wl = server.client()  # the service finds processes in its own table only, and this one started none
    try:
        r = wl.unary(method, doc)
        assert r.status_code == 200 or (r.status_code in (400, 404, 501) and r.json()["code"] != "internal"), r.text
        with wl.stream("process.Process/Connect", doc) as messages:  # a server stream: the error in its trailer
            end = next(messages)
        assert end.get("__end__", {}).get("error", {}).get("code") in ("invalid_argument", "not_found", "unimplemented")
    finally:
        wl.http.close()


def test_a_malformed_field_is_invalid_argument_with_its_name(server: ServerProcess) -> None:
    wl = server.client()
    try:
        cases: list[tuple[str, dict[str, Any], str]] = [
            ("process.Process/SendSignal", {"process": {"pid": "x"}}, "pid must be an integer"),
            ("process.Process/SendInput", {"process": {"tag": 7}}, "tag must be a string"),
            (
                "process.Process/Update",
                {"process": {"tag": "t"}, "pty": {"size": {"cols": -1}}},
                "cols must be a uint32",
            ),
            ("filesystem.Filesystem/ListDir", {"path": "/", "depth": True}, "depth must be a uint32"),
            ("filesystem.Filesystem/RemoveWatcher", {"watcherId": ["w"]}, "watcher_id must be a string"),
        ]
        for method, body, text in cases:
            r = wl.unary(method, body)
            assert (r.status_code, r.json()) == (400, {"code": "invalid_argument", "message": text}), method
        stream = wl.collect("process.Process/Start", {"process": {"cmd": "true", "envs": {"A": 1}}})
        assert stream.error == {"code": "invalid_argument", "message": "envs must be a map of strings"}
    finally:
        wl.http.close()


# ---- the host's client reads events as messages ---------------------------------------------------------------


def _host(events: list[bytes]) -> HostClient:
    def handler(request: httpx.Request) -> httpx.Response:
        body = httpx.ByteStream(b"".join(events))
        return httpx.Response(200, stream=body, headers={"Content-Type": "application/connect+json"})

    return HostClient(httpx.Client(base_url="http://w", transport=httpx.MockTransport(handler)), "t")


def test_the_host_client_reads_the_service_events() -> None:
    out: list[bytes] = []
    wire = [
        encode_json(m.ProcessEvent(m.StartEvent(42)).to_json()),
        encode_json(m.ProcessEvent(m.DataEvent("stdout", b"hi\n")).to_json()),
        encode_json(m.ProcessEvent(m.KeepAlive()).to_json()),
        encode_json(m.ProcessEvent(end_event(-signal.SIGKILL)).to_json()),
        encode_json({}, 2),
    ]
    result = _host(wire).exec(["x"], on_stdout=out.append)
    assert (result.exit_code, result.status, result.pid, out) == (137, "signal: killed", 42, [b"hi\n"])
    refused = [encode_json({"error": {"code": "not_found", "message": "no"}}, 2)]
    with pytest.raises(CubeError) as e:
        _host(refused).exec(["x"])
    assert (e.value.code, e.value.details) == ("workload.refused", {"connect_code": "not_found"})


@pytest.mark.parametrize(
    "bad",
    [
        encode_json({"event": {"start": {"pid": "x"}}}),
        encode_json({"event": {"data": {"stdout": "!!"}}}),
        encode_json({"event": {"end": {"exitCode": "one"}}}),
        encode_json({"event": []}),
        encode_json({"error": "boom"}, 2),
        b"\x00\x00\x00\x00\x01{",
    ],
)
def test_a_malformed_event_is_a_bad_reply_not_a_crash(bad: bytes) -> None:
    """Before the events were typed, most of these raised ValueError, AttributeError or JSONDecodeError."""
    with pytest.raises(CubeError) as e:
        _host([bad, encode_json({}, 2)]).exec(["x"])
    assert e.value.code == "workload.bad_reply"


def test_connect_codes_are_unchanged() -> None:
    assert c.invalid(pj.ProtoJsonError("pid must be a uint32")).to_json() == {
        "code": "invalid_argument",
        "message": "pid must be a uint32",
    }


# ---- the guest's metrics ------------------------------------------------------------------------------------

counts = st.integers(0, 2**53)
samples = st.builds(
    MetricsSample,
    counts,
    counts,
    st.floats(0, 100),
    counts,
    counts,
    counts,
    counts,
    counts,
    counts,
    counts,
)
pci = st.builds(PciFunction, names, names, names, names, names)


@given(samples, pci)
def test_metrics_are_written_as_before_and_read_by_the_host_field_for_field(
    sample: MetricsSample, device: PciFunction
) -> None:
    old_sample = {  # metrics.py's dict, in its order
        "ts": sample.ts,
        "cpu_count": sample.cpu_count,
        "cpu_used_pct": sample.cpu_used_pct,
        "mem_total_mib": sample.mem_total_mib,
        "mem_used_mib": sample.mem_used_mib,
        "mem_total": sample.mem_total,
        "mem_used": sample.mem_used,
        "mem_cache": sample.mem_cache,
        "disk_used": sample.disk_used,
        "disk_total": sample.disk_total,
    }
    old_device = {"address": device.address, "vendor": device.vendor, "device": device.device}
    old_device |= {"class": device.pci_class, "driver": device.driver}
    series = MetricsSeries((sample,), (device,))
    assert dumps(series.to_json()) == dumps({"samples": [old_sample], "devices": [old_device]})
    assert MetricsSeries.from_json(json.loads(dumps(series.to_json()))) == series
    host = GuestMetrics.model_validate_json(dumps(series.to_json()))  # the front door's reader
    assert host.samples[0].model_dump() == {k: v for k, v in old_sample.items() if not k.endswith("_mib")}
    assert host.devices[0].model_dump(by_alias=True) == old_device
