"""cube-agent's typed messages (protocol/agent_messages.py) against the dict code they replaced.

Old guest images in the image cache talk to new shims and the other way round, so every line must stay byte for
byte what the dict code wrote: the `_old_*` helpers below are that code, kept verbatim, and each test encodes the
same values both ways. Hypothesis round-trips every message and feeds the parsers and the agent's line decoder
arbitrary input: a catalogued CubeError or a reply, never another exception.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cubeaccel.agent.probes import ProbeContext
from cubeaccel.agent.protocol import Agent, encode
from cubeaccel.agent.serve import ServeOptions, serve
from cubeaccel.protocol import agent_messages as M
from cubeaccel.protocol.agent_protocol import GUEST_ERROR_CODES, PROTOCOL_VERSION
from cubeaccel.protocol.agent_protocol import MAX_DEADLINE_SCALE as MAX_SCALE
from cubeaccel.protocol.error_catalog import CATALOG
from cubeaccel.protocol.errors import CubeError
from cubeaccel.protocol.reports import (
    CudaInfo,
    GuestPciDevice,
    GuestReport,
    LibraryInfo,
    NvmlDevice,
    NvmlInfo,
    ProbeResult,
)
from cubeaccel.shim.agent_client import AgentClient
from tests.unit.test_agent_fakes import EDU, FakeGuest

ADDR = "0000:01:00.0"
SEED = "ab" * 32


# ---- the dict code as it was -------------------------------------------------------------------------------
def _old_shim_line(rid: int, method: str, params: dict[str, Any]) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, "id": rid, "method": method, "params": params}).encode() + b"\n"


def _old_reply_ok(request_id: Any, result: dict[str, Any]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "result": result}


def _old_reply_error(request_id: Any, err: CubeError) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": False, **err.to_json()}


def _old_hello(kernel: str, boot_id: str | None, pid: int, uptime: float, addresses: list[str]) -> dict[str, Any]:
    return {
        "agent_version": 1,
        "protocol": PROTOCOL_VERSION,
        "methods": list(M.METHODS),
        "kernel_release": kernel,
        "boot_id": boot_id,
        "pid": pid,
        "uptime_s": uptime,
        "pci_addresses": addresses,
    }


def _old_reseed(mixed: bool, why_not: str | None, credited: int = 0, reseeded: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"mixed": mixed, "credited_bits": 0, "crng_reseeded": False}
    if why_not is not None:
        out["why_not"] = why_not
    else:
        out["credited_bits"] = credited
        out["crng_reseeded"] = reseeded
    return out


def _old_cuda(stage: str) -> dict[str, Any]:
    """agent/cuda.query_cuda's dict, stopped at `stage` (userspace._no_cuda for "none")."""
    out: dict[str, Any] = {"driver_version": None, "init_ok": False, "device_count": None, "error": None}
    if stage == "none":
        out["error"] = "libcuda.so.1: cannot open shared object file"
        return out
    out["driver_version"] = 12040
    out["driver_version_text"] = "12.4"
    if stage == "version":
        out["error"] = "cuInit not called: the kernel driver did not load"
        return out
    out["init_ms"] = 812.5
    out["init_result"] = 100 if stage == "init_failed" else 0
    if stage == "init_failed":
        out["error"] = "cuInit: CUDA_ERROR_NO_DEVICE"
        return out
    out["init_ok"] = True
    out["device_count"] = 8
    return out


def _old_nvml_device(index: int, ok: bool, set_result: int | None) -> dict[str, Any]:
    dev: dict[str, Any] = {"index": index}
    if not ok:
        dev["error"] = "nvmlDeviceGetHandleByIndex_v2 returned 2"
        return dev
    dev["name"] = "NVIDIA H100 80GB HBM3"
    dev["memory_total_bytes"] = 85520809984
    dev["persistence_mode"] = False
    if set_result is not None:
        dev["persistence_set_result"] = set_result
        dev["persistence_mode"] = set_result == 0
    return dev


def _old_nvml() -> dict[str, Any]:
    out: dict[str, Any] = {"driver_version": None, "device_count": None, "devices": [], "error": None}
    out["driver_version"] = "550.54.15"
    out["device_count"] = 3
    out["devices"] += [_old_nvml_device(0, True, 0), _old_nvml_device(1, True, None), _old_nvml_device(2, False, None)]
    return out


PROBE = ProbeResult("cuda:init", False, "cuda_runtime", "compat.cuda_init_failed", "CUDA_SUCCESS", None, 812.5, "x")


def _old_report(cuda: dict[str, Any] | None, nvml: dict[str, Any] | None) -> dict[str, Any]:
    """GuestReport.to_json() was asdict() over dict fields."""
    return {
        "agent_version": 1,
        "kernel_release": "6.1.0-27-amd64",
        "modules_loaded": ("nvidia", "nvidia_uvm"),
        "module_failures": {"nvidia_drm": "modprobe: FATAL"},
        "driver_refusal": None,
        "pci_devices": ({"address": ADDR, "vendor_id": "10de", "device_id": "2330", "class": "030200"},),
        "device_files": {"/dev/nvidia0": True, "/dev/nvidiactl": False},
        "kernel_driver_version": "550.54.15",
        "libraries": {
            "libcuda.so.1": {
                "loaded": True,
                "path": "/usr/lib/libcuda.so.550.54.15",
                "version": "550.54.15",
                "error": None,
            },
            "libnvidia-ml.so.1": {"loaded": False, "path": None, "version": None, "error": "not found"},
        },
        "cuda": cuda,
        "nvml": nvml,
        "probes": (asdict(PROBE),),
    }


def _agent_bytes(message: dict[str, Any]) -> bytes:
    return encode(message)


# ---- byte for byte -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "old", "new"),
    [
        ("hello", {}, M.Request(1, "hello").params),
        ("probe", {"contract": {"probes": {}}, "load_modules": False}, M.ProbeParams({"probes": {}}, False).to_json()),
        ("probe", {"contract": {"probes": {"pci": []}}}, M.ProbeParams({"probes": {"pci": []}}).to_json()),
        (
            "wait_pci",
            {"vendor_id": "1234", "device_id": "11e8", "known": sorted({ADDR, "0000:00:01.0"}), "timeout_s": 9.87},
            M.WaitPciParams("1234", "11e8", tuple(sorted({ADDR, "0000:00:01.0"})), 9.87).to_json(),
        ),
        ("pci_resources", {"address": ADDR}, M.PciResourcesParams(ADDR).to_json()),
        ("reseed", {"seed": SEED}, M.ReseedParams(SEED).to_json()),
        ("shutdown", {"poweroff": False}, M.ShutdownParams(poweroff=False).to_json()),
    ],
)
def test_the_shims_request_lines_are_the_old_bytes(method: str, old: dict[str, Any], new: dict[str, Any]) -> None:
    assert json.dumps(M.Request(7, method, new).to_json()).encode() + b"\n" == _old_shim_line(7, method, old)


def test_the_agents_result_lines_are_the_old_bytes() -> None:
    hello = M.HelloResult(1, 1, M.METHODS, "6.1.0-27-amd64", None, 41, 0.512, (ADDR,))
    device = M.PciFunction(ADDR, "1234", "11e8", "00ff00")
    cases: list[tuple[dict[str, Any], M.Json]] = [
        (_old_hello("6.1.0-27-amd64", None, 41, 0.512, [ADDR]), hello.to_json()),
        (
            {"device": {"address": ADDR, "vendor_id": "1234", "device_id": "11e8", "class": "00ff00"}, "waited_ms": 3.1}
            | {"uevents": True},
            M.WaitPciResult(device, 3.1, True).to_json(),
        ),
        ({"device": None, "waited_ms": 200.4, "uevents": False}, M.WaitPciResult(None, 200.4, False).to_json()),
        ({"address": ADDR, "resource": "0x00 0x00 0x0\n"}, M.PciResourcesResult(ADDR, "0x00 0x00 0x0\n").to_json()),
        ({"address": ADDR, "resource": None}, M.PciResourcesResult(ADDR, None).to_json()),
        (
            _old_reseed(True, "not a character device"),
            M.ReseedResult(True, 0, False, "not a character device").to_json(),
        ),
        (_old_reseed(True, None, 256, True), M.ReseedResult(True, 256, True).to_json()),
        ({"stopping": True, "poweroff": True}, M.ShutdownResult(True, True).to_json()),
        (
            {"ok": False, "failures": {"nvidia": "FATAL"}, "modules_loaded": ["virtio_pci"], "probes": [asdict(PROBE)]},
            M.LoadModulesResult(False, {"nvidia": "FATAL"}, ("virtio_pci",), (PROBE,)).to_json(),
        ),
        (
            {
                "ok": False,
                "failed": ["cuda:init"],
                "failed_layers": ["cuda_runtime"],
                "report": {"agent_version": 1},
                "violations": [],
                "contract_check": "skipped",
            },
            M.ProbeReply(False, ("cuda:init",), ("cuda_runtime",), {"agent_version": 1}, [], "skipped").to_json(),
        ),
    ]
    for old, new in cases:
        assert _agent_bytes(_old_reply_ok(3, old)) == _agent_bytes(M.Reply(3, result=new).to_json())
    err = M.invalid_params("seed must be 64 lower-case hex digits (32 bytes)")
    assert _agent_bytes(_old_reply_error("x", err)) == _agent_bytes(M.Reply("x", error=err).to_json())
    old_ready = {
        "v": PROTOCOL_VERSION,
        "event": "ready",
        "result": _old_hello("6.1.0-27-amd64", None, 41, 0.512, [ADDR]),
    }
    assert _agent_bytes(old_ready) == _agent_bytes(M.ReadyEvent(hello).to_json())


@pytest.mark.parametrize("cuda_stage", [None, "none", "version", "init_failed", "full"])
@pytest.mark.parametrize("with_nvml", [False, True])
def test_a_guest_report_with_typed_cuda_nvml_and_libraries_is_the_old_json(
    cuda_stage: str | None, with_nvml: bool
) -> None:
    old = _old_report(None if cuda_stage is None else _old_cuda(cuda_stage), _old_nvml() if with_nvml else None)
    old_bytes = json.dumps(old, separators=(",", ":"))
    parsed = GuestReport.from_json(json.loads(old_bytes))  # what the Cubelet reads
    assert json.dumps(parsed.to_json(), separators=(",", ":")) == old_bytes
    assert parsed.cuda is None or parsed.cuda.driver_version in (None, 12040)


def test_an_older_agents_hello_without_pci_addresses_is_relayed_as_it_was_sent() -> None:
    """Images built before `wait_pci` answer hello without `pci_addresses`: the GUEST_READY report keeps it so."""
    old = _old_hello("6.1.0-27-amd64", "0f6a", 7, 1.5, [])
    del old["pci_addresses"]
    old["methods"] = ["hello", "probe", "load_modules", "shutdown"]
    hello = M.HelloResult.from_json(old)
    assert hello.pci_addresses is None and json.dumps(hello.to_json()) == json.dumps(old)


def test_the_agent_builds_the_cuda_and_nvml_records_in_the_old_key_order() -> None:
    """agent/cuda.py's typed records encode with the keys the dict code added, in that order."""
    assert list(CudaInfo(error="x").to_json()) == list(_old_cuda("none"))
    assert list(CudaInfo(12040, error="e", driver_version_text="12.4").to_json()) == list(_old_cuda("version"))
    failed = CudaInfo(12040, False, None, "e", "12.4", 1.0, 100)
    assert list(failed.to_json()) == list(_old_cuda("init_failed"))
    assert list(CudaInfo(12040, True, 8, None, "12.4", 1.0, 0).to_json()) == list(_old_cuda("full"))
    assert [list(d.to_json()) for d in NvmlInfo.from_json(_old_nvml()).devices] == [  # type: ignore[union-attr]
        list(d) for d in _old_nvml()["devices"]
    ]
    assert list(NvmlInfo().to_json()) == ["driver_version", "device_count", "devices", "error"]
    assert list(LibraryInfo(False).to_json()) == ["loaded", "path", "version", "error"]
    assert NvmlDevice(0, persistence_mode=True).to_json() == {"index": 0, "persistence_mode": True}


# ---- over a real channel: the new shim and the agent -------------------------------------------------------
@pytest.fixture
def channel(tmp_path: Path) -> Iterator[tuple[AgentClient, FakeGuest]]:
    g = FakeGuest(tmp_path / "guest").pci(ADDR, *EDU)
    (g.root / "sys/bus/pci/devices" / ADDR / "resource").write_text("0x00000000fea00000 0x00000000feafffff 0x0040200\n")
    (g.root / "dev/urandom").write_text("")  # a regular file: mixed, never credited
    path = tmp_path / "agent.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    agent = Agent(ctx=ProbeContext(root=g.root), load_modules_default=False)

    def run() -> None:
        conn, _ = srv.accept()
        with conn:
            serve(agent, conn.fileno(), conn.fileno(), ServeOptions(eof="exit"))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    client = AgentClient(path)
    client.connect(5.0)
    try:
        yield client, g
    finally:
        client.close()
        srv.close()
        t.join(10.0)


def test_the_shim_reads_each_agent_answer_as_its_typed_result(channel: tuple[AgentClient, FakeGuest]) -> None:
    client, _ = channel
    hello = client.wait_hello(10.0)
    assert hello.methods == M.METHODS and hello.pci_addresses == (ADDR,) and hello.pid == os.getpid()
    assert hello.kernel_release == "6.1.0-27-amd64" and hello.boot_id is not None
    assert client.ready_event is not None and client.ready_event.hello.methods == M.METHODS
    assert [d.vendor_device for d in client.pci_devices()] == [f"{EDU[0]}:{EDU[1]}"]
    found = client.wait_pci(M.WaitPciParams(EDU[0], EDU[1], (), 1.0), timeout_s=5.0).device
    assert found is not None and found.address == ADDR and found.class_ == "00ff00"
    assert client.pci_resources(ADDR, timeout_s=5.0).resource == "0x00000000fea00000 0x00000000feafffff 0x0040200\n"
    seeded = client.reseed(SEED, timeout_s=5.0)
    assert (seeded.mixed, seeded.reseeded, seeded.why_not) == (True, False, "not a character device")
    assert seeded.facts() == {"mixed": True, "credited_bits": 0, "crng_reseeded": False, "why_not": seeded.why_not}
    reply = client.probe(M.ProbeParams({"probes": {"pci": [{"vendor_id": EDU[0], "device_id": EDU[1]}]}}), 10.0)
    assert reply.ok and reply.report is not None and reply.contract_check is not None
    with pytest.raises(CubeError) as bad:
        client.call("pci_resources", {"address": "nope"}, timeout_s=5.0)
    assert bad.value.code == "agent.invalid_params"


# ---- what is new: refused clearly, read leniently ----------------------------------------------------------
def test_a_scrub_timeout_that_is_not_a_number_is_refused_not_an_internal_error() -> None:
    """The dict code did float(params["timeout_s"]): "soon" was an agent.internal_error (a ValueError)."""
    line = json.dumps({"v": 1, "id": 1, "method": "scrub", "params": {"method": "cuda", "timeout_s": "soon"}})
    reply = Agent(ctx=ProbeContext(root=Path("/nonexistent"))).handle_line(line.encode())
    assert reply is not None and reply["ok"] is False
    assert reply["error"]["code"] == "agent.invalid_params"
    assert reply["error"]["message"] == "timeout_s must be a positive number"


@pytest.mark.parametrize(
    ("result", "check"),
    [
        ({"device": {"address": 5, "vendor_id": "1234", "device_id": "11e8"}}, "wait_pci"),
        ({"device": "0000:01:00.0"}, "wait_pci"),
        ({"resource": ["not", "text"]}, "pci_resources"),
        ({"mixed": "yes", "crng_reseeded": 1}, "reseed"),
        ({"methods": "hello", "pci_addresses": 7, "pid": "x"}, "hello"),
        ({"ok": 1, "report": "a string", "violations": {}}, "probe"),
    ],
)
def test_a_mistyped_result_field_from_the_guest_reads_as_absent(result: dict[str, Any], check: str) -> None:
    if check == "wait_pci":
        assert M.WaitPciResult.from_json(result).device is None
    elif check == "pci_resources":
        assert M.PciResourcesResult.from_json(result).resource is None
    elif check == "reseed":
        r = M.ReseedResult.from_json(result)
        assert (r.mixed, r.crng_reseeded, r.reseeded) == (None, None, False)
    elif check == "hello":
        h = M.HelloResult.from_json(result)
        assert (h.methods, h.pci_addresses, h.pid) == (None, None, None)
    else:
        p = M.ProbeReply.from_json(result)
        assert (p.ok, p.report, p.violations) == (False, None, None)


# ---- Hypothesis ---------------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
json_objects = st.dictionaries(st.text(max_size=12), json_values, max_size=5)
hex4 = st.text("0123456789abcdef", min_size=4, max_size=4)
addresses = st.builds(
    lambda d, b, s, f: f"{d}:{b}:{s}.{f}",
    hex4,
    st.text("0123456789abcdef", min_size=2, max_size=2),
    st.sampled_from([f"{i:02x}" for i in range(32)]),
    st.integers(0, 7),
)
words = st.text(max_size=12)
opt_words = st.none() | words
PARAMS = (
    M.ProbeParams,
    M.LoadModulesParams,
    M.ScrubParams,
    M.WaitPciParams,
    M.PciResourcesParams,
    M.ReseedParams,
    M.ShutdownParams,
)


def _catalogued(err: CubeError) -> None:
    assert err.code in CATALOG and err.code != "agent.internal_error"


@settings(max_examples=300, deadline=None)
@given(data=json_objects, which=st.sampled_from(PARAMS))
def test_each_params_parser_answers_arbitrary_json_with_params_or_a_catalogued_error(
    data: dict[str, Any], which: Any
) -> None:
    try:
        which.from_json(data)
    except CubeError as err:
        _catalogued(err)


RESULTS = (
    M.HelloResult,
    M.ProbeReply,
    M.LoadModulesResult,
    M.WaitPciResult,
    M.PciResourcesResult,
    M.ReseedResult,
    M.ReadyEvent,
)


@settings(max_examples=300, deadline=None)
@given(data=json_objects, which=st.sampled_from(RESULTS))
def test_each_result_parser_reads_arbitrary_json_from_a_guest_without_raising(data: dict[str, Any], which: Any) -> None:
    json.dumps(which.from_json(data).to_json())  # and what it read encodes again


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=300) | json_objects.map(lambda o: json.dumps(o).encode()))
def test_the_agents_line_decoder_answers_arbitrary_bytes_with_a_catalogued_error(raw: bytes) -> None:
    reply = Agent(ctx=ProbeContext(root=Path("/nonexistent"))).handle_line(raw)
    if reply is None:
        assert not raw.strip()
        return
    assert reply["ok"] is False and reply["error"]["code"] in GUEST_ERROR_CODES
    assert reply["error"]["code"] != "agent.internal_error"
    encode(reply)


SAFE_METHODS = ("hello", "pci_resources", "reseed", "shutdown")  # none runs modprobe or waits


@settings(max_examples=200, deadline=None)
@given(method=st.sampled_from(SAFE_METHODS), params=json_objects, rid=st.integers() | words)
def test_the_agent_answers_arbitrary_params_with_a_result_or_a_catalogued_error(
    method: str, params: dict[str, Any], rid: int | str
) -> None:
    line = json.dumps({"v": 1, "id": rid, "method": method, "params": params}).encode()
    reply = Agent(ctx=ProbeContext(root=Path("/nonexistent"))).handle_line(line)
    assert reply is not None
    if not reply["ok"]:
        assert reply["error"]["code"] in GUEST_ERROR_CODES and reply["error"]["code"] != "agent.internal_error"


pci_functions = st.builds(M.PciFunction, addresses, hex4, hex4, st.none() | st.text("0123456789abcdef", max_size=6))
floats = st.floats(allow_nan=False, allow_infinity=False)
typed_messages = st.one_of(
    st.builds(
        M.HelloResult,
        st.integers(0, 9),
        st.integers(0, 9),
        st.lists(words).map(tuple),
        words,
        opt_words,
        st.integers(0, 2**22),
        floats,
        st.none() | st.lists(addresses, max_size=3).map(tuple),
    ),
    st.builds(M.WaitPciParams, hex4, hex4, st.lists(addresses, max_size=4).map(tuple), st.floats(0.001, 30.0)),
    st.builds(M.WaitPciResult, st.none() | pci_functions, st.none() | floats, st.none() | st.booleans()),
    st.builds(M.PciResourcesParams, addresses),
    st.builds(M.PciResourcesResult, st.none() | addresses, opt_words),
    st.builds(M.ReseedParams, st.text("0123456789abcdef", min_size=64, max_size=64)),
    st.builds(
        M.ReseedResult, st.none() | st.booleans(), st.none() | st.integers(0, 256), st.none() | st.booleans(), opt_words
    ),
    st.builds(M.ShutdownParams, st.booleans()),
    st.builds(
        M.ProbeParams, st.none() | json_objects, st.none() | st.booleans(), st.none() | st.floats(1.0, MAX_SCALE)
    ),
    st.builds(
        M.ProbeReply,
        st.booleans(),
        st.lists(words).map(tuple),
        st.lists(words).map(tuple),
        st.none() | json_objects,
        st.none() | st.lists(json_objects, max_size=2),
        opt_words,
    ),
    st.builds(
        M.LoadModulesResult,
        st.booleans(),
        st.dictionaries(words, words, max_size=3),
        st.lists(words, max_size=3).map(tuple),
        st.lists(st.builds(ProbeResult, words, st.booleans(), words, words, opt_words, opt_words, floats, words)).map(
            tuple
        ),
    ),
)


@settings(max_examples=400, deadline=None)
@given(message=typed_messages)
def test_every_message_round_trips_through_its_json_line(message: Any) -> None:
    line = encode(message.to_json())
    assert type(message).from_json(json.loads(line)) == message


reports = st.builds(
    GuestReport,
    st.integers(0, 9),
    words,
    st.lists(words, max_size=3).map(tuple),
    st.dictionaries(words, words, max_size=2),
    opt_words,
    st.lists(
        pci_functions.map(lambda p: GuestPciDevice.from_json({k: str(v) for k, v in p.to_json().items()})), max_size=2
    ).map(tuple),
    st.dictionaries(words, st.booleans(), max_size=2),
    opt_words,
    st.dictionaries(words, st.builds(LibraryInfo, st.booleans(), opt_words, opt_words, st.none() | words.filter(bool))),
    st.none()
    | st.builds(
        CudaInfo,
        st.none() | st.integers(1000, 99999),
        st.booleans(),
        st.none() | st.integers(0, 64),
        st.none() | words.filter(bool),
        opt_words,
        st.none() | floats,
        st.none() | st.integers(0, 999),
    ),
    st.none()
    | st.builds(
        NvmlInfo,
        opt_words,
        st.none() | st.integers(0, 64),
        st.lists(
            st.builds(
                NvmlDevice,
                st.integers(0, 63),
                opt_words,
                opt_words,
                st.none() | st.integers(0),
                st.none() | st.booleans(),
                st.none() | st.integers(),
            ),
            max_size=2,
        ).map(tuple),
        opt_words,
    ),
    st.lists(st.builds(ProbeResult, words, st.booleans(), words, words, opt_words, opt_words, floats, words)).map(
        tuple
    ),
)


@settings(max_examples=200, deadline=None)
@given(report=reports)
def test_a_guest_report_round_trips_through_its_json(report: GuestReport) -> None:
    assert GuestReport.from_json(json.loads(json.dumps(report.to_json()))) == report


def test_load_modules_reads_no_probe_flag_and_no_contract_when_it_names_its_modules() -> None:
    """Only `probe` has a `load_modules` flag; `load_modules` with its own list never looks at `contract`."""
    assert M.LoadModulesParams.from_json({"modules": ["a"], "load_modules": "x", "contract": 5}).contract is None
    with pytest.raises(CubeError) as bad:
        M.LoadModulesParams.from_json({"contract": 5})
    assert (bad.value.code, bad.value.message) == ("agent.invalid_contract", "contract must be a JSON object")


@pytest.mark.parametrize("scale", [0.5, MAX_SCALE + 1, "2", True, None, float("nan")])
def test_a_deadline_scale_out_of_its_range_is_refused_by_name(scale: object) -> None:
    """The host's load stretch is 1..MAX_DEADLINE_SCALE: a guest never waits without bound on a host's word."""
    for params in (M.ProbeParams, M.LoadModulesParams):
        with pytest.raises(CubeError) as bad:
            params.from_json({"modules": ["a"], "deadline_scale": scale})
        assert bad.value.code == "agent.invalid_params" and "deadline_scale" in bad.value.message


def test_an_older_shims_probe_has_no_deadline_scale_and_a_newer_one_sends_it() -> None:
    assert M.ProbeParams({"probes": {}}).to_json() == {"contract": {"probes": {}}}  # byte for byte as before
    sent = M.ProbeParams({"probes": {}}, deadline_scale=2.5).to_json()
    assert sent["deadline_scale"] == 2.5 and M.ProbeParams.from_json(sent).deadline_scale == 2.5
    assert M.LoadModulesParams.from_json(M.LoadModulesParams(["a"], deadline_scale=3).to_json()).deadline_scale == 3


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"method": "bar-memory", "address": ADDR, "resource": ["resource0"]}, "PCI address and resource0..5"),
        ({"method": "bar", "address": ADDR, "layout": {"edu": 1}}, "PCI address and a known layout"),
    ],
)
def test_a_scrub_resource_or_layout_that_is_not_text_is_refused_not_an_internal_error(
    params: dict[str, Any], message: str
) -> None:
    """The dict code looked an unhashable value up in a frozenset: a TypeError, answered as agent.internal_error."""
    line = json.dumps({"v": 1, "id": 1, "method": "scrub", "params": params})
    reply = Agent(ctx=ProbeContext(root=Path("/nonexistent"))).handle_line(line.encode())
    assert reply is not None and reply["error"]["code"] == "agent.invalid_params"
    assert message in reply["error"]["message"]


def test_a_probe_verdict_the_guest_got_wrong_reads_as_absent_in_load_modules_result() -> None:
    """The dict code passed each entry to ProbeResult(**entry): a number or a missing field raised TypeError."""
    good = asdict(PROBE)
    result = M.LoadModulesResult.from_json({"ok": True, "probes": [1, {"name": "x"}, good, "p"]})
    assert result.ok and result.probes == (PROBE,)
