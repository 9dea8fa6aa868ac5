"""`sandbox exec`'s stdin pump (issue 30 #9): a daemon thread still blocked reading an open stdin when the command
has ended must not abort the interpreter at exit (SIGABRT, rc 134), which would replace the command's exit code."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Starts the pump on this process's real stdin (a pipe the test keeps open), waits until the pump's thread is
# blocked in read(0) (Linux: /proc/self/task/<tid>/syscall), then exits with the "command's" code 7.
SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from cubeaccel.transport.workload_client import WorkloadClient

    client = WorkloadClient.over("http://127.0.0.1:9/v1/sandboxes/x/workload", "t" * 32)
    client._feed_stdin(1, sys.stdin.buffer)
    pump = next(t for t in threading.enumerate() if t.name == "exec stdin")
    deadline = time.monotonic() + 30
    while open(f"/proc/self/task/{pump.native_id}/syscall").read().split()[:2] != ["0", "0x0"]:
        if time.monotonic() > deadline:
            raise SystemExit("the pump never blocked in read(0)")
    raise SystemExit(7)
    """
)


def test_an_exec_whose_stdin_stays_open_exits_with_the_commands_code() -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert p.stdin is not None and p.stderr is not None
    try:
        rc = p.wait(60)  # stdin still open: the pump is blocked reading it
        err = p.stderr.read().decode()
    finally:
        p.stdin.close()
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert rc == 7, err
