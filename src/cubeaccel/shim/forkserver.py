"""The shim fork server: one pre-started process per Cubelet that forks a ready shim per sandbox start.

A spawned shim spends ~0.3 s of every sandbox start importing (pydantic models, qemu.qmp, httpx) before it
does anything (measured by bench/shim_bench.py). This process imports all of that once and then forks: the
child is a shim with its imports done, in its own session, with the environment, working directory and log
Cubelet sent (what `Popen` would have given it), showing the same argv in /proc (host/service/proctitle.py) — so
Cubelet's liveness checks, restarts and kills see no difference. Cubelet falls back to spawning on any
refusal, so this is only ever a faster path, never the only one.

It is single-threaded (a fork from a threaded process is unsafe) and trusts only its own uid (SO_PEERCRED).
It exits when Cubelet does (its stdin is Cubelet's pipe and reads EOF); shims it forked live on, like spawned
shims outlive Cubelet. Children are reaped here as they exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import NoReturn

import httpx  # noqa: F401 - preloaded: the shim's reporter imports it in socket mode
from pydantic import ValidationError

from cubeaccel.host.service import proctitle
from cubeaccel.host.service.private import private_umask
from cubeaccel.host.service.unix_path import connect_path
from cubeaccel.shim import entry
from cubeaccel.shim import process as _process  # noqa: F401 - preloaded: what a forked shim runs
from cubeaccel.wire.shim_launch import MAX_REQUEST_BYTES, SOCKET_NAME, ShimLaunchReply, ShimLaunchRequest

READY_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 5.0


def serve(directory: Path) -> int:
    """Listen at `directory`/forkserver.sock until stdin (Cubelet's pipe) closes."""
    private_umask()
    proctitle.set_cmdline(sys.orig_argv[: sys.orig_argv.index(proctitle.ROOM_FLAG)])  # proves rewriting works
    path = directory / SOCKET_NAME
    listener = _listen(path)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the loop; reaping happens in it
    print(f"forkserver ready: {path}", file=sys.stderr, flush=True)
    try:
        while True:
            ready = select.select([listener, sys.stdin.fileno(), wake_r], [], [], 5.0)[0]
            _reap()
            if wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
            if sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 512):
                return 0  # Cubelet is gone: so are we (our shims are not)
            if listener in ready:
                with contextlib.suppress(OSError):
                    conn, _ = listener.accept()
                    with conn:
                        _serve_one(conn, listener, (wake_r, wake_w))
    finally:
        listener.close()


def _listen(path: Path) -> socket.socket:
    """Bound under a temporary name and renamed: a client never connects to a socket that is not listening."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(connect_path(tmp))
    s.listen(16)
    os.replace(tmp, path)
    return s


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _reply(conn: socket.socket, pid: int | None = None, error: str | None = None) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(ShimLaunchReply(pid=pid, error=error[:2000] if error else None).model_dump_json().encode())


def _serve_one(conn: socket.socket, listener: socket.socket, own_fds: tuple[int, int]) -> None:
    conn.settimeout(REQUEST_TIMEOUT_S)
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    peer_uid = struct.unpack("3i", creds)[1]
    if peer_uid != os.getuid():
        _reply(conn, error=f"uid {peer_uid} may not start shims here")
        return
    log_fd = -1
    try:
        data, fds, _flags, _addr = socket.recv_fds(conn, MAX_REQUEST_BYTES, 2)
        for extra in fds[1:]:
            os.close(extra)
        log_fd = fds[0] if fds else -1
        while chunk := conn.recv(MAX_REQUEST_BYTES):
            data += chunk
            if len(data) > MAX_REQUEST_BYTES:
                raise ValueError(f"request over {MAX_REQUEST_BYTES} bytes")
        if log_fd < 0:
            raise ValueError("no log descriptor came with the request")
        req = ShimLaunchRequest.model_validate_json(data)
    except (OSError, ValueError, ValidationError) as e:
        if log_fd >= 0:
            os.close(log_fd)
        _reply(conn, error=f"bad request: {e}"[:500])
        return
    try:
        ready_r, ready_w = os.pipe()
    except OSError as e:
        os.close(log_fd)
        _reply(conn, error=f"cannot fork a shim: {e}")
        return
    try:
        pid = os.fork()
    except OSError as e:  # EAGAIN, ENOMEM: Cubelet spawns this one instead
        for fd in (ready_r, ready_w, log_fd):
            os.close(fd)
        _reply(conn, error=f"cannot fork a shim: {e}")
        return
    if pid == 0:  # the shim: never returns into this loop
        os.close(ready_r)
        _become_shim(req, log_fd, ready_w, (conn.fileno(), listener.fileno(), *own_fds))
    os.close(ready_w)
    os.close(log_fd)
    with open(ready_r, "rb") as ready:
        word = ready.read(1) if select.select([ready], [], [], READY_TIMEOUT_S)[0] else b""
        if word == b"1":
            _reply(conn, pid=pid)
            return
        why = ready.read(1000).decode(errors="replace") if word else ""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # not findable as a shim: it must not run at all
    _reply(conn, error=why or "the forked shim did not come up")


def _become_shim(req: ShimLaunchRequest, log_fd: int, ready_w: int, close_fds: tuple[int, ...]) -> NoReturn:
    """The child's whole life: it always ends in `os._exit` (it must never fall back into the server's loop),
    and runs the shim only once its argv shows and the server heard so (a broken ready pipe means the server is
    gone and no one will learn this pid: then it does not run at all)."""
    rc = 1
    try:
        try:
            os.setsid()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the shim waits for its own children (the VMM)
            for fd in close_fds:
                os.close(fd)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.close(devnull)
            os.close(log_fd)
            os.chdir(req.cwd)
            os.environ.clear()
            os.environ.update(req.env)
            proctitle.set_cmdline(list(req.argv))
            sys.argv = list(req.argv[2:])
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.write(ready_w, b"0" + f"{type(e).__name__}: {e}".encode()[:900])
            raise SystemExit(121) from None
        os.write(ready_w, b"1")
        os.close(ready_w)
        args = entry.parser().parse_args(list(req.argv[3:]))  # `run ...`: the request's model checked the prefix
        token = req.workload_token.get_secret_value() if req.workload_token is not None else None
        rc = entry.run(args, workload_token=token)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        with contextlib.suppress(BaseException):
            logging.getLogger("cubeaccel.shim").exception("forked shim failed")
        rc = 1
    finally:
        with contextlib.suppress(BaseException):
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        os._exit(rc)
