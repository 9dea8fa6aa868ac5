"""cube-workload's pure pieces: Connect envelopes, HTTP/1.1 bodies, multipart, and envd's field formats."""

from __future__ import annotations

import io
import itertools
import json
import os
import pwd
import signal
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.protocol import proto_json as pj
from cubeaccel.workload import connect as c
from cubeaccel.workload.app import _accepts_gzip
from cubeaccel.workload.files import Multipart, go_mode_string, timestamp
from cubeaccel.workload.http1 import Body, HttpError
from cubeaccel.workload.process import end_event
from cubeaccel.workload.users import User, expand_and_resolve

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
messages = st.dictionaries(st.text(max_size=10), json_values, max_size=6)


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({x % (len(data) + 1) for x in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@given(st.lists(messages, max_size=8), st.lists(st.integers(0, 5000), max_size=10))
def test_envelopes_round_trip_through_any_chunking(msgs: list[dict[str, object]], cuts: list[int]) -> None:
    wire = b"".join(c.encode_envelope(m) for m in msgs) + c.end_stream()
    decoder = c.EnvelopeDecoder()
    out: list[c.Envelope] = []
    for piece in pieces(wire, cuts):
        out += decoder.feed(piece)
    decoder.finish()
    assert [e.message() for e in out[:-1]] == msgs
    assert out[-1].flags == c.FLAG_END_STREAM and out[-1].message() == {}


def test_envelope_layout_and_errors() -> None:
    assert c.encode_envelope({"a": 1}) == b"\x00\x00\x00\x00\x07" + b'{"a":1}'
    err = c.end_stream(c.ConnectError("not_found", "no such pid"))
    assert err[0] == 0x02 and json.loads(err[5:]) == {"error": {"code": "not_found", "message": "no such pid"}}
    decoder = c.EnvelopeDecoder(max_message=10)
    with pytest.raises(c.ConnectError) as e:
        decoder.feed(b"\x00\x00\x00\x00\x0b")  # refused from the prefix alone
    assert e.value.code == "resource_exhausted"
    decoder = c.EnvelopeDecoder()
    decoder.feed(c.encode_envelope({"x": 1})[:-1])
    with pytest.raises(c.ConnectError) as e:
        decoder.finish()
    assert e.value.code == "invalid_argument"
    with pytest.raises(c.ConnectError):
        c.Envelope(0, b"[1]").message()  # a message is an object


def test_proto_json_field_access() -> None:
    msg = {"exitCode": 3, "symlink_target": "x", "pid": "12", "data": "/w==", "url": "_-8", "sig": "SIGNAL_SIGKILL"}
    assert pj.get(msg, "exit_code") == 3 and pj.get_str(msg, "symlink_target") == "x"
    assert pj.get_uint32(msg, "pid") == 12  # numbers may arrive as strings
    assert pj.get_bytes(msg, "data") == b"\xff" and pj.get_bytes(msg, "url") == b"\xff\xef"
    assert pj.get_enum(msg, "sig", {"SIGNAL_SIGKILL": 9}) == 9
    for bad in ({"pid": -1}, {"pid": 2**32}, {"pid": True}, {"pid": "x"}):
        with pytest.raises(pj.ProtoJsonError):
            pj.get_uint32(bad, "pid")
    with pytest.raises(pj.ProtoJsonError):
        pj.get_bytes({"d": "!!"}, "d")
    assert {
        code: c.ConnectError(code, "").http_status for code in ("unauthenticated", "not_found", "unimplemented")
    } == {
        "unauthenticated": 401,
        "not_found": 404,
        "unimplemented": 501,
    }


def _body(wire: bytes, length: int | None, chunked: bool) -> Body:
    return Body(io.BufferedReader(io.BytesIO(wire)), length, chunked, lambda: None)


def chunked_encoding(data: bytes, sizes: list[int]) -> bytes:
    out, rest = bytearray(), data
    for size in itertools.cycle(sizes or [len(data) or 1]):
        if not rest:
            break
        part, rest = rest[: max(1, size)], rest[max(1, size) :]
        out += b"%x;ext=1\r\n" % len(part) + part + b"\r\n"
    return bytes(out) + b"0\r\nTrailer: x\r\n\r\n"


@given(st.binary(max_size=3000), st.lists(st.integers(1, 700), max_size=6), st.integers(1, 900))
def test_chunked_bodies_decode_whatever_the_chunk_sizes(data: bytes, sizes: list[int], read: int) -> None:
    body = _body(chunked_encoding(data, sizes) + b"NEXT", None, True)
    out = bytearray()
    while chunk := body.read(read):
        out += chunk
    assert bytes(out) == data and body.done


@pytest.mark.parametrize(
    "wire", [b"zz\r\nabc\r\n0\r\n\r\n", b"5\r\nabc", b"3\r\nabcXX0\r\n\r\n", b"3\r\nabc\r\n", b"-1\r\n"]
)
def test_malformed_chunked_bodies_are_refused(wire: bytes) -> None:
    body = _body(wire, None, True)
    with pytest.raises(HttpError) as err:
        while body.read(100):
            pass
    assert err.value.status == 400


def test_fixed_length_body_and_limits() -> None:
    assert _body(b"hello world", 5, False).read_all(100) == b"hello"
    with pytest.raises(HttpError) as err:
        _body(b"x" * 50, 50, False).read_all(10)
    assert err.value.status == 413
    with pytest.raises(HttpError):
        _body(b"abc", 10, False).read_all(100)  # the peer promised more than it sent


@given(
    st.lists(st.tuples(st.sampled_from(["file", "other"]), st.binary(max_size=300)), min_size=1, max_size=4),
    st.lists(st.integers(0, 2000), max_size=8),
)
def test_multipart_parts_stream_out_intact(parts: list[tuple[str, bytes]], cuts: list[int]) -> None:
    boundary = "b0undary-XyZ"
    wire = bytearray(b"preamble\r\n")
    for name, content in parts:
        wire += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="f"\r\n\r\n'.encode()
        wire += content + b"\r\n"
    wire += f"--{boundary}--\r\nepilogue".encode()
    feed = iter(pieces(bytes(wire), cuts))

    def read(n: int) -> bytes:
        return next(feed, b"")

    got = []
    for headers, part in Multipart(read, boundary).parts():
        data = bytearray()
        while chunk := part(7):
            data += chunk
        got.append((headers.get_param("name", header="content-disposition"), bytes(data)))
    assert got == parts


def test_multipart_cut_short_is_an_error() -> None:
    wire = b'--b\r\nContent-Disposition: form-data; name="file"\r\n\r\nsome bytes but no end'
    feed = iter([wire])
    with pytest.raises(HttpError):
        for _, part in Multipart(lambda n: next(feed, b""), "b").parts():
            while part(100):
                pass


def test_go_file_mode_strings(tmp_path: Path) -> None:
    assert go_mode_string(stat.S_IFREG | 0o644) == "-rw-r--r--"
    assert go_mode_string(stat.S_IFDIR | 0o1777) == "dtrwxrwxrwx"
    assert go_mode_string(stat.S_IFLNK | 0o777) == "Lrwxrwxrwx"
    assert go_mode_string(stat.S_IFCHR | 0o666) == "Dcrw-rw-rw-"
    assert go_mode_string(stat.S_IFREG | 0o4755) == "urwxr-xr-x"


def test_protojson_timestamps() -> None:
    assert timestamp(0) == "1970-01-01T00:00:00Z"
    assert timestamp(1_500_000_000) == "1970-01-01T00:00:01.500Z"
    assert timestamp(1_000_001_000) == "1970-01-01T00:00:01.000001Z"
    assert timestamp(1_000_000_001) == "1970-01-01T00:00:01.000000001Z"


def test_end_events_match_go_process_state() -> None:
    assert end_event(0).to_json() == {"exited": True, "status": "exit status 0"}
    assert end_event(2).to_json() == {
        "exitCode": 2,
        "exited": True,
        "status": "exit status 2",
        "error": "exit status 2",
    }
    assert end_event(-signal.SIGTERM).to_json() == {
        "exitCode": -1,
        "status": "signal: terminated",
        "error": "signal: terminated",
    }


def test_paths_resolve_as_envd_resolves_them() -> None:
    user = User("u", 1000, 1000, "/home/u")
    assert expand_and_resolve("", user, None) == "/home/u"
    assert expand_and_resolve("", user, "/work") == "/work"
    assert expand_and_resolve("a/../../etc/passwd", user, None) == "/home/etc/passwd"  # cleaned, not confined
    assert expand_and_resolve("~/x/./y", user, None) == "/home/u/x/y"
    assert expand_and_resolve("~", user, None) == "/home/u"
    assert expand_and_resolve("/abs/../kept", user, None) == "/abs/../kept"  # absolute: as given (Go does too)
    with pytest.raises(c.ConnectError) as err:
        expand_and_resolve("~root/x", user, None)
    assert err.value.code == "invalid_argument"


@pytest.mark.parametrize(
    ("header", "gzip"),
    [
        ("", False),
        ("gzip", True),
        ("gzip, deflate", True),
        ("identity", False),
        ("gzip;q=0", False),
        ("identity;q=1, gzip;q=0.5", False),
        ("*", False),
        ("*, identity;q=0", True),
        ("br", False),
    ],
)
def test_accept_encoding(header: str, gzip: bool) -> None:
    assert _accepts_gzip(header) is gzip


def test_a_connection_from_a_pair_of_raw_byte_streams(tmp_path: Path) -> None:
    """The listener seam: HTTP served over two pipes (no socket), as a mux stream or any byte pair would be."""
    import threading

    from cubeaccel.workload.app import Workload
    from cubeaccel.workload.http1 import buffered_pair, serve_connection

    to_server_r, to_server_w = os.pipe()
    from_server_r, from_server_w = os.pipe()
    closed = threading.Event()
    conn = buffered_pair(io.FileIO(to_server_r, "r"), io.FileIO(from_server_w, "w"), closed.set)
    app = Workload(token=b"t", default_user=pwd.getpwuid(os.geteuid()).pw_name)
    server = threading.Thread(target=serve_connection, args=(conn, app), daemon=True)
    server.start()
    body = json.dumps({"path": str(tmp_path)}).encode()
    os.write(
        to_server_w,
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /filesystem.Filesystem/Stat HTTP/1.1\r\nHost: x\r\nX-Access-Token: t\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
    )
    os.close(to_server_w)  # EOF after two keep-alive requests
    server.join(10)
    assert not server.is_alive()
    conn.writer.close()  # type: ignore[attr-defined]  # our write end: the reader below then sees EOF
    with io.FileIO(from_server_r, "r") as f:
        reply = f.read()
    assert reply.startswith(b"HTTP/1.1 204 No Content\r\n")
    second = reply.split(b"HTTP/1.1 ", 2)[2]
    assert second.startswith(b"200 OK") and b'"FILE_TYPE_DIRECTORY"' in second
    assert closed.is_set()
