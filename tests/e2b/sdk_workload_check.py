"""Drive cube-workload with the real E2B Python SDK (run by a Python that has `e2b`; not a project dependency).

Usage: python sdk_workload_check.py URL TOKEN ENVD_VERSION SCRATCH_DIR. Exits non-zero at the first mismatch; prints
one line per check. The Sandbox object is built directly (no REST create): envd at URL, token in X-Access-Token.
"""

from __future__ import annotations

import os
import sys

from e2b import CommandExitException, Sandbox
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import AuthenticationException, FileNotFoundException
from packaging.version import Version


def sandbox(url: str, token: str, version: str) -> Sandbox:
    headers = {"X-Access-Token": token, "E2b-Sandbox-Id": "sdk-check", "E2b-Sandbox-Port": "49983"}
    cfg = ConnectionConfig(api_key="unused", sandbox_url=url, extra_sandbox_headers=headers)
    return Sandbox(
        sandbox_id="sdk-check",
        sandbox_domain=None,
        envd_version=Version(version),
        envd_access_token=token,
        traffic_access_token=None,
        connection_config=cfg,
    )


def main() -> int:
    url, token, version, scratch = sys.argv[1:5]
    sbx = sandbox(url, token, version)
    r = sbx.commands.run("echo hi; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "err\n", 0), r
    assert sbx.commands.run("echo $A; pwd", envs={"A": "b"}, cwd=scratch).stdout == f"b\n{scratch}\n"
    try:
        sbx.commands.run("echo bad >&2; exit 4")
        raise AssertionError("non-zero exit did not raise")
    except CommandExitException as e:
        assert (e.exit_code, e.stderr) == (4, "bad\n")
    h = sbx.commands.run("sleep 30", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is True
    try:
        h.wait()
        raise AssertionError("killed command did not raise")
    except CommandExitException as e:
        assert e.exit_code == -1 and e.error == "signal: killed"
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello\n")
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "hello\n"
    h = sbx.commands.run("sleep 0.5; echo late", background=True)
    assert sbx.commands.connect(h.pid).wait().stdout == "late\n"
    from e2b.sandbox.commands.command_handle import PtySize

    got = bytearray()
    term = sbx.pty.create(PtySize(rows=24, cols=80), cwd=scratch)
    sbx.pty.resize(term.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(term.pid, b"stty size; exit 0\n")
    term.wait(on_pty=lambda data: got.extend(data))
    assert b"40 120" in got, bytes(got)
    h = sbx.commands.run("cat", background=True, stdin=True)
    if hasattr(sbx.commands, "stream_input"):
        sbx.commands.stream_input(h.pid, ["a", b"b\n"])
    else:
        sbx.commands.send_stdin(h.pid, "ab\n")
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "ab\n"
    blob = os.urandom(5 * 1024 * 1024)
    info = sbx.files.write(f"{scratch}/sdk/blob.bin", blob)
    assert info.path == f"{scratch}/sdk/blob.bin"
    assert sbx.files.read(f"{scratch}/sdk/blob.bin", format="bytes") == blob
    sbx.files.write_files([{"path": f"{scratch}/sdk/m1", "data": "one"}, {"path": f"{scratch}/sdk/m2", "data": b"2"}])
    assert sbx.files.read(f"{scratch}/sdk/m1") == "one"
    assert [e.name for e in sbx.files.list(f"{scratch}/sdk")] == ["blob.bin", "m1", "m2"]
    assert sbx.files.get_info(f"{scratch}/sdk/blob.bin").size == len(blob)
    assert sbx.files.exists(f"{scratch}/sdk/m1") and not sbx.files.exists(f"{scratch}/sdk/none")
    assert sbx.files.make_dir(f"{scratch}/sdk/d") is True and sbx.files.make_dir(f"{scratch}/sdk/d") is False
    assert sbx.files.rename(f"{scratch}/sdk/m1", f"{scratch}/sdk/d/m1").path == f"{scratch}/sdk/d/m1"
    sbx.files.remove(f"{scratch}/sdk/d")
    assert not sbx.files.exists(f"{scratch}/sdk/d")
    try:
        sbx.files.read(f"{scratch}/sdk/none")
        raise AssertionError("missing file did not raise")
    except FileNotFoundException:
        pass
    assert sbx.is_running()
    bad = sandbox(url, "wrong-token", version)
    for call in (lambda: bad.commands.run("echo no"), lambda: bad.files.read(f"{scratch}/sdk/m2")):
        try:
            call()
            raise AssertionError("wrong token accepted")
        except AuthenticationException:
            pass
    print("e2b sdk: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
