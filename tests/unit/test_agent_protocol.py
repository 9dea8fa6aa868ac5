"""cube-agent's JSON-lines protocol: framing, dispatch, and the serve loop over real byte streams.

Garbage, truncated and oversized input must each get an error reply, and the next request must still
be served. The serve loop runs on a socketpair, a pty in raw mode, and as a real `cube-agent` process.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cubeaccel.agent.probes import ProbeContext
from cubeaccel.agent.protocol import Agent, LineFramer
from cubeaccel.agent.serve import ServeOptions, serve
from cubeaccel.guest.virtio_port import resolve_port
from cubeaccel.protocol.agent_messages import METHODS
from cubeaccel.protocol.errors import CubeError
from tests.support.poll import poll
from tests.unit.test_agent_fakes import EDU, FakeGuest

EDU_SPEC = {"kernel_release": "6.1.0-27-amd64", "pci": [{"vendor_id": EDU[0], "device_id": EDU[1]}]}


class Peer:
    """The host side of the channel: writes bytes, reads reply lines with a deadline (own line buffer)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf = fd, b""

    def send(self, data: bytes | dict[str, Any]) -> None:
        raw = data if isinstance(data, bytes) else json.dumps(data).encode() + b"\n"
        view = memoryview(raw)
        while view:
            select.select([], [self.fd], [], 5.0)
            view = view[os.write(self.fd, view) :]

    def line(self, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no reply line within {timeout}s (have {self.buf[:200]!r})"
            if select.select([self.fd], [], [], remaining)[0]:
                chunk = os.read(self.fd, 65536)
                assert chunk, "agent closed the channel"
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def reply_to(self, request_id: object, timeout: float = 10.0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The reply with this id, and every other reply seen before it (error replies to garbage)."""
        others: list[dict[str, Any]] = []
        while True:
            message = self.line(timeout)
            if message.get("id") == request_id and "event" not in message:
                return message, others
            others.append(message)

    def call(self, method: str, request_id: object = 1, **params: Any) -> dict[str, Any]:
        self.send({"v": 1, "id": request_id, "method": method, "params": params})
        return self.reply_to(request_id)[0]


@contextmanager
def served(agent: Agent, options: ServeOptions) -> Iterator[tuple[Peer, threading.Thread]]:
    """The real serve loop in a thread on one end of a socketpair; the test holds the other end."""
    ours, theirs = socket.socketpair()
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(serve(agent, theirs.fileno(), theirs.fileno(), options)), daemon=True
    )
    thread.start()
    peer = Peer(ours.fileno())
    try:
        assert peer.line()["event"] == "ready"
        yield peer, thread
    finally:
        ours.close()  # EOF ends the loop (eof="exit")
        thread.join(10)
        theirs.close()
        assert not thread.is_alive()


OPTIONS = ServeOptions(max_request_bytes=4096, read_timeout_s=0.3)


# ---- framing and dispatch (pure) -------------------------------------------------------------------


def test_framer_splits_lines_across_chunks_and_keeps_the_partial_tail() -> None:
    f = LineFramer(64)
    assert f.feed(b'{"a"') == [] and f.partial == 4
    assert f.feed(b':1}\n{"b":2}\n{"c"') == [b'{"a":1}', b'{"b":2}']
    assert f.partial == 4


def test_framer_turns_an_oversized_line_into_one_error_and_skips_to_its_end() -> None:
    f = LineFramer(16)
    out = f.feed(b"x" * 40)
    assert len(out) == 1 and isinstance(out[0], CubeError) and out[0].code == "agent.request_too_large"
    assert f.feed(b"y" * 100) == []
    assert f.feed(b"zz\nok\n") == [b"ok"]
    assert f.partial == 0


@given(st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=8), st.data())
def test_framer_output_does_not_depend_on_how_the_stream_is_chunked(lines: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(line + b"\n" for line in lines)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    f, out = LineFramer(1 << 20), []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        out += f.feed(stream[start:end])
    assert out == lines


@given(st.binary(max_size=300))
def test_any_line_of_bytes_gets_at_most_one_json_reply_and_never_raises(line: bytes) -> None:
    reply = Agent(ctx=ProbeContext(root=Path("/nonexistent"))).handle_line(line)
    if reply is not None:
        assert reply["v"] == 1 and isinstance(reply["ok"], bool)
        json.dumps(reply)
        if not reply["ok"]:
            assert reply["error"]["code"].startswith(("agent.", "compat."))


@given(
    st.dictionaries(
        st.sampled_from(["v", "id", "method", "params", "x"]),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=20), lambda c: st.lists(c, max_size=3)
        ),
    )
)
def test_any_json_object_gets_a_reply_never_an_exception(request: dict[str, Any]) -> None:
    agent = Agent(ctx=ProbeContext(root=Path("/nonexistent"), modprobe=("/nonexistent/modprobe",)))
    reply = agent.handle_line(json.dumps(request).encode())
    assert reply is not None and isinstance(reply["ok"], bool)
    json.dumps(reply)


@pytest.mark.parametrize(
    "line, code",
    [
        (b"\xff\xfe not utf-8", "agent.bad_json"),
        (b'{"v":1,"id":1,"method":"probe"', "agent.bad_json"),
        (b"[1,2,3]", "agent.bad_request"),
        (b'{"v":2,"id":1,"method":"hello"}', "agent.unsupported_version"),
        (b'{"v":1,"id":1,"method":"reboot"}', "agent.unknown_method"),
        (b'{"v":1,"id":{"x":1},"method":"hello"}', "agent.bad_request"),
        (b'{"v":1,"id":1,"method":"hello","params":[1]}', "agent.invalid_params"),
        (b'{"v":1,"id":1,"method":"probe"}', "agent.invalid_contract"),
        (b'{"v":1,"id":1,"method":"probe","params":{"contract":{},"load_modules":"yes"}}', "agent.invalid_params"),
        (b"[" * 100000, "agent.bad_json"),
    ],
)
def test_bad_requests_get_stable_error_codes(line: bytes, code: str) -> None:
    reply = Agent(ctx=ProbeContext(root=Path("/nonexistent"))).handle_line(line)
    assert reply is not None and reply["ok"] is False and reply["error"]["code"] == code


def test_error_reply_echoes_the_request_id_when_it_could_be_read() -> None:
    reply = Agent().handle_line(b'{"v":1,"id":"req-7","method":"nope"}')
    assert reply is not None and reply["id"] == "req-7" and reply["error"]["details"]["methods"] == list(METHODS)


# ---- the serve loop on real byte streams -----------------------------------------------------------


def test_hello_over_a_socketpair_reports_versions_kernel_and_boot_id(tmp_path: Path) -> None:
    FakeGuest(tmp_path)
    with served(Agent(ctx=ProbeContext(root=tmp_path)), OPTIONS) as (peer, _):
        result = peer.call("hello", request_id="h1")["result"]
    assert result["agent_version"] == 1 and result["protocol"] == 1 and result["methods"] == list(METHODS)
    assert result["kernel_release"] == "6.1.0-27-amd64"
    assert result["boot_id"] == "0f6a3c3e-1111-2222-3333-444455556666"


def test_random_garbage_gets_error_replies_and_the_next_request_is_still_served() -> None:
    with served(Agent(ctx=ProbeContext(root=Path("/nonexistent"))), OPTIONS) as (peer, _):
        counter = iter(range(10**6))

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.binary(min_size=1, max_size=600))
        def check(garbage: bytes) -> None:
            request_id = f"after-{next(counter)}"
            peer.send(garbage + b"\n")
            peer.send({"v": 1, "id": request_id, "method": "hello"})
            reply, others = peer.reply_to(request_id)
            assert reply["ok"] is True
            assert all(o["ok"] is False and o["error"]["code"].startswith("agent.") for o in others)

        check()
        assert next(counter) >= 100  # the examples really went over the wire


def test_a_huge_line_gets_one_too_large_error_and_the_agent_keeps_serving() -> None:
    with served(Agent(), OPTIONS) as (peer, _):
        peer.send(b'{"v":1,"id":1,"method":"hello","pad":"' + b"A" * (2 * 1024 * 1024) + b'"}\n')
        reply, others = peer.reply_to(None)
        assert reply["error"]["code"] == "agent.request_too_large" and reply["error"]["details"]["limit"] == 4096
        assert others == []
        assert peer.call("hello", request_id=2)["ok"] is True


def test_a_truncated_request_times_out_with_an_error_and_the_next_request_works() -> None:
    with served(Agent(), OPTIONS) as (peer, _):
        peer.send(b'{"v":1,"id":1,"meth')
        reply = peer.line(timeout=5.0)
        assert reply["error"]["code"] == "agent.read_timeout" and reply["error"]["details"]["bytes"] == 19
        assert peer.call("hello", request_id=2)["ok"] is True


def test_probe_over_the_wire_returns_the_guest_report_of_the_fake_root(tmp_path: Path) -> None:
    FakeGuest(tmp_path).pci("0000:01:00.0", *EDU)
    with served(Agent(ctx=ProbeContext(root=tmp_path)), ServeOptions(max_request_bytes=65536)) as (peer, _):
        reply = peer.call("probe", request_id=3, contract=EDU_SPEC)
    result = reply["result"]
    assert reply["ok"] is True and result["ok"] is True and result["failed"] == []
    assert result["report"]["pci_devices"][0]["address"] == "0000:01:00.0"
    assert [p["name"] for p in result["report"]["probes"]] == ["guest_kernel", "pci"]


def test_probe_uses_the_configured_contract_and_loads_modules_first(tmp_path: Path) -> None:
    guest = FakeGuest(tmp_path)
    ctx = ProbeContext(root=tmp_path, modprobe=(guest.modprobe({"nvidia": "FATAL: Module nvidia not found"}),))
    agent = Agent(ctx=ctx, contract={"modules": ["nvidia", "edu"]})
    with served(agent, OPTIONS) as (peer, _):
        result = peer.call("probe")["result"]
        loaded = peer.call("load_modules", request_id=2, modules=["virtio_rng"])["result"]
    assert result["report"]["module_failures"] == {"nvidia": "FATAL: Module nvidia not found"}
    assert result["failed"] == ["modprobe:nvidia"] and result["failed_layers"] == ["modules_img"]
    assert loaded["ok"] is True and loaded["modules_loaded"] == ["edu", "virtio_rng"]


def test_a_vendor_scrub_loads_the_images_driver_first_and_fails_in_its_words(tmp_path: Path) -> None:
    """A scrub VM booted from a vendor image sends the image's driver modules with the scrub: a driver that does
    not load ends the scrub as a failure naming why, before any library is tried (agent/protocol.py `_m_scrub`)."""
    guest = FakeGuest(tmp_path)
    ctx = ProbeContext(root=tmp_path, modprobe=(guest.modprobe({"nvidia": "modprobe: ERROR: No such device"}),))
    with served(Agent(ctx=ctx), OPTIONS) as (peer, _):
        peer.send(
            {"v": 1, "id": 1, "method": "scrub", "params": {"method": "cuda", "modules": ["nvidia", "nvidia_uvm"]}}
        )
        refused = peer.reply_to(1)[0]["result"]
        peer.send({"v": 1, "id": 2, "method": "scrub", "params": {"method": "cuda", "modules": ["../evil"]}})
        bad = peer.reply_to(2)[0]
    assert refused["ok"] is False and refused["method"] == "cuda" and refused["bytes_zeroed"] == 0
    assert refused["error"].startswith("driver not loaded: ") and "No such device" in refused["error"]
    assert bad["ok"] is False  # module names are validated as a contract's are


def test_a_contract_that_says_load_modules_false_gets_no_modprobe(tmp_path: Path) -> None:
    """The template's guest-init step: modules must already be loaded; the agent runs nothing."""
    guest = FakeGuest(tmp_path)
    ctx = ProbeContext(root=tmp_path, modprobe=(guest.modprobe({"nvidia": "FATAL: Module nvidia not found"}),))
    agent = Agent(ctx=ctx, contract={"modules": ["nvidia"], "load_modules": False})
    with served(agent, OPTIONS) as (peer, _):
        result = peer.call("probe")["result"]
    assert result["report"]["module_failures"] == {}
    assert not any(p["name"].startswith("modprobe:") for p in result["report"]["probes"])
    assert result["failed_layers"] == ["modules_img"]  # still checked: nvidia is not loaded


def _slow_modprobe(root: Path, seconds: float) -> str:
    """A modprobe that succeeds after `seconds` (a big module under TCG on a loaded host)."""
    script = root / "slow-modprobe.sh"
    script.write_text(f'#!/bin/sh\nsleep {seconds}\necho "$1 16384 0 - Live 0x0" >> "{root}/proc/modules"\n')
    script.chmod(0o755)
    return str(script)


def test_a_probe_from_a_loaded_host_stretches_the_modprobe_deadline_by_the_hosts_figure(tmp_path: Path) -> None:
    """The host sends its load stretch with the probe: a modprobe that outlasts the idle deadline but not the
    stretched one loads, and is not reported as a timeout at the wrong layer."""
    FakeGuest(tmp_path)
    ctx = ProbeContext(root=tmp_path, modprobe=(_slow_modprobe(tmp_path, 1.0),), modprobe_timeout_s=0.6)
    with served(Agent(ctx=ctx), OPTIONS) as (peer, _):
        idle = peer.call("probe", request_id=1, contract={"modules": ["nvidia"]})["result"]
        loaded = peer.call("probe", request_id=2, contract={"modules": ["nvidia"]}, deadline_scale=3.0)["result"]
        modules = peer.call("load_modules", request_id=3, modules=["nvidia_uvm"], deadline_scale=3.0)["result"]
    assert idle["report"]["module_failures"] == {"nvidia": "modprobe timed out after 0.6s"}
    assert loaded["report"]["module_failures"] == {}
    assert "modprobe:nvidia" not in loaded["failed"] and "modprobe:nvidia" in idle["failed"]
    assert modules["ok"] is True and "nvidia_uvm" in modules["modules_loaded"]


def test_the_guests_own_load_stretches_its_deadlines_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    ctx = ProbeContext(root=tmp_path, modprobe_timeout_s=30.0, cuda_timeout_s=20.0)
    assert ctx.stretched(None) is ctx  # no /proc/loadavg under the fake root: idle
    (tmp_path / "proc").mkdir(exist_ok=True)
    (tmp_path / "proc/loadavg").write_text("4.00 1.00 0.50 2/80 123\n")
    assert (ctx.stretched(None).modprobe_timeout_s, ctx.stretched(None).cuda_timeout_s) == (60.0, 40.0)
    assert ctx.stretched(3.0).modprobe_timeout_s == 90.0  # the larger figure wins
    (tmp_path / "proc/loadavg").write_text("40.0 1.00 0.50 2/80 123\n")
    assert ctx.stretched(None).modprobe_timeout_s == 90.0  # never more than MAX_DEADLINE_SCALE


def test_shutdown_replies_then_ends_the_serve_loop() -> None:
    agent = Agent()
    with served(agent, OPTIONS) as (peer, thread):
        reply = peer.call("shutdown", request_id=9, poweroff=True)
        thread.join(5)
        assert not thread.is_alive()
    assert reply["result"] == {"stopping": True, "poweroff": True} and agent.poweroff_requested


def test_a_raw_mode_pty_carries_requests_longer_than_a_canonical_tty_line(tmp_path: Path) -> None:
    """A serial console is a tty: canonical mode would echo input and cut lines at 4096 bytes."""
    master, slave = os.openpty()
    agent = Agent(ctx=ProbeContext(root=tmp_path))
    thread = threading.Thread(
        target=serve, args=(agent, slave, slave, ServeOptions(max_request_bytes=65536)), daemon=True
    )
    thread.start()
    try:
        peer = Peer(master)
        assert peer.line()["event"] == "ready"
        padded = {"v": 1, "id": "long", "method": "hello", "params": {"pad": "p" * 10000}}
        peer.send(padded)
        assert peer.reply_to("long")[0]["ok"] is True
        assert peer.call("shutdown", request_id="bye")["ok"] is True
        thread.join(5)
        assert not thread.is_alive()
    finally:
        os.close(master)
        thread.join(5)
        os.close(slave)


def agent_process(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "cubeaccel.agent", "serve", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_cube_agent_serve_stdio_process_answers_and_exits_0_on_shutdown(tmp_path: Path) -> None:
    FakeGuest(tmp_path).pci("0000:01:00.0", *EDU)
    (tmp_path / "edu.json").write_text(json.dumps(EDU_SPEC))
    proc = agent_process("--stdio", "--root", str(tmp_path), "--contract", str(tmp_path / "edu.json"))
    assert proc.stdin is not None and proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    try:
        reader = Peer(proc.stdout.fileno())
        assert reader.line()["event"] == "ready"
        requests = [b"\x00garbage\n", b'{"v":1,"id":1,"method":"probe"}\n', b'{"v":1,"id":2,"method":"shutdown"}\n']
        proc.stdin.write(b"".join(requests))
        proc.stdin.flush()
        assert reader.line()["error"]["code"] == "agent.bad_json"
        assert reader.line()["result"]["ok"] is True
        assert reader.line()["result"]["stopping"] is True
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_cube_agent_serve_opens_a_port_by_device_path(tmp_path: Path) -> None:
    """--port on a device path (a pty stands in for the virtio-serial port's character device)."""
    master, slave = os.openpty()
    proc = agent_process("--port", os.ttyname(slave), "--root", str(FakeGuest(tmp_path).root))
    try:
        peer = Peer(master)
        assert peer.line()["event"] == "ready"
        assert peer.call("hello", request_id=1)["result"]["pid"] == proc.pid
        assert peer.call("shutdown", request_id=2)["ok"] is True
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
        os.close(slave)


def test_port_mode_waits_across_host_eof_instead_of_exiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A virtio-serial port reads EOF while the host is disconnected; the agent must still be there after."""
    real_read, eofs = os.read, [0]
    ours, theirs = socket.socketpair()

    def flaky_read(fd: int, n: int) -> bytes:
        if fd == theirs.fileno() and eofs[0] < 2:
            eofs[0] += 1
            return b""
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", flaky_read)
    agent = Agent()
    thread = threading.Thread(
        target=serve, args=(agent, theirs.fileno(), theirs.fileno(), ServeOptions(eof="wait")), daemon=True
    )
    thread.start()
    try:
        peer = Peer(ours.fileno())
        assert peer.line()["event"] == "ready"
        assert peer.call("hello", request_id=1)["ok"] is True
        assert eofs[0] == 2 and thread.is_alive()
        assert peer.call("shutdown", request_id=2)["ok"] is True
        thread.join(5)
        assert not thread.is_alive()
    finally:
        ours.close()
        thread.join(5)
        theirs.close()


def test_half_a_line_from_a_host_that_went_away_does_not_spoil_the_next_hosts_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_read, eof_next = os.read, [False]
    ours, theirs = socket.socketpair()

    def read_then_eof(fd: int, n: int) -> bytes:
        if fd != theirs.fileno():
            return real_read(fd, n)
        if eof_next[0]:
            eof_next[0] = False
            return b""  # the old host disconnects after sending half a line
        data = real_read(fd, n)
        eof_next[0] = not data.endswith(b"\n")
        return data

    monkeypatch.setattr(os, "read", read_then_eof)
    thread = threading.Thread(
        target=serve, args=(Agent(), theirs.fileno(), theirs.fileno(), ServeOptions(eof="wait")), daemon=True
    )
    thread.start()
    try:
        peer = Peer(ours.fileno())
        assert peer.line()["event"] == "ready"
        peer.send(b'{"v":1,"id":')
        poll(lambda: eof_next[0], 5, 0.01, what="agent read the half line on its own")
        peer.send({"v": 1, "id": 2, "method": "hello"})
        reply, others = peer.reply_to(2)
        assert reply["ok"] is True
        assert all("event" in o for o in others)  # a fresh `ready`, and no error about the stale half line
        assert peer.call("shutdown", request_id=3)["ok"] is True
    finally:
        ours.close()
        thread.join(5)
        theirs.close()


def test_port_names_resolve_through_virtio_ports_links_or_sysfs_names(tmp_path: Path) -> None:
    (tmp_path / "sys/class/virtio-ports/vport1p1").mkdir(parents=True)
    (tmp_path / "sys/class/virtio-ports/vport1p1/name").write_text("org.cubeaccel.agent.0\n")
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/vport1p1").touch()
    assert resolve_port("org.cubeaccel.agent.0", tmp_path) == tmp_path / "dev/vport1p1"
    (tmp_path / "dev/virtio-ports").mkdir()
    (tmp_path / "dev/virtio-ports/org.cubeaccel.agent.0").symlink_to("../vport1p1")
    assert resolve_port("org.cubeaccel.agent.0", tmp_path) == tmp_path / "dev/virtio-ports/org.cubeaccel.agent.0"
    with pytest.raises(CubeError) as err:
        resolve_port("org.other", tmp_path, wait_s=0.1)
    assert err.value.code == "guest.port_not_found"
