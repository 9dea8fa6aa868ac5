"""Processes as envd runs them (envd internal/services/process): one handler per command, output fanned out.

Each command runs in its own session and process group (so SIGKILL and the timeout reach everything it started),
as the requested user when we are root. Two reader threads move stdout/stderr in 32 KiB chunks to every
subscribed stream through bounded queues: a stream that stops reading blocks the readers, the pipe fills and the
command blocks in write(2). Nothing grows without bound. Output produced while nobody is subscribed is dropped,
as envd does. An exited command's end event is kept 30 s so a late `Connect` still learns the exit code.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from cubeaccel.protocol.envd_process import (
    SIGNALS,
    DataEvent,
    EndEvent,
    ListResponse,
    ProcessConfig,
    ProcessInfo,
    ProcessSelector,
    StartRequest,
)
from cubeaccel.workload.connect import ConnectError
from cubeaccel.workload.limits import CommandLimits
from cubeaccel.workload.users import User, expand_and_resolve

CHUNK = 32 * 1024
SUBSCRIBER_QUEUE = 16  # chunks per subscriber: at most 512 KiB of output held per stream
RETENTION_S = 30.0
KILL_GRACE_S = 2.0  # after a kill, how long we wait for output pipes held open by escaped descendants
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

SIGNAL_NAMES: dict[int, str] = {
    signal.SIGHUP: "hangup",
    signal.SIGINT: "interrupt",
    signal.SIGQUIT: "quit",
    signal.SIGILL: "illegal instruction",
    signal.SIGTRAP: "trace/breakpoint trap",
    signal.SIGABRT: "aborted",
    signal.SIGBUS: "bus error",
    signal.SIGFPE: "floating point exception",
    signal.SIGKILL: "killed",
    signal.SIGUSR1: "user defined signal 1",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGUSR2: "user defined signal 2",
    signal.SIGPIPE: "broken pipe",
    signal.SIGALRM: "alarm clock",
    signal.SIGTERM: "terminated",
}
SIGNAL_ENUM = SIGNALS


def end_event(returncode: int) -> EndEvent:
    """EndEvent as envd fills it from Go's ProcessState (status strings included)."""
    if returncode >= 0:
        status = f"exit status {returncode}"
        return EndEvent(returncode, True, status, status if returncode else None)
    signum = -returncode
    status = f"signal: {SIGNAL_NAMES.get(signum, f'signal {signum}')}"
    return EndEvent(-1, False, status, status)


class Subscriber:
    """One stream's view of a process: bounded queue of output chunks, then the end event."""

    def __init__(self, maxlen: int = SUBSCRIBER_QUEUE) -> None:
        self._items: deque[DataEvent] = deque()
        self._maxlen = maxlen
        self._cv = threading.Condition()
        self._end: EndEvent | None = None
        self.cancelled = False

    def put(self, data: DataEvent) -> None:
        """Blocks while full: this is the backpressure that reaches the command's write(2)."""
        with self._cv:
            while len(self._items) >= self._maxlen and not self.cancelled:
                self._cv.wait()
            if not self.cancelled:
                self._items.append(data)
                self._cv.notify_all()

    def finish(self, end: EndEvent) -> None:
        with self._cv:
            self._end = end
            self._cv.notify_all()

    def get(self, timeout: float | None) -> DataEvent | EndEvent | None:
        """Next chunk, else the end event once all chunks are out, else None after `timeout` (send a keepalive)."""
        with self._cv:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._items and self._end is None and not self.cancelled:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cv.wait(remaining)
            if self._items:
                item = self._items.popleft()
                self._cv.notify_all()
                return item
            return self._end

    def cancel(self) -> None:
        with self._cv:
            self.cancelled = True
            self._items.clear()
            self._cv.notify_all()


@dataclass
class Process:
    pid: int
    config: ProcessConfig  # as given, for List
    tag: str | None
    popen: subprocess.Popen[bytes]
    _subscribers: list[Subscriber] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stdin_lock: threading.Lock = field(default_factory=threading.Lock)
    end: EndEvent | None = None
    killed: threading.Event = field(default_factory=threading.Event)
    tty: int | None = None  # the pty master, for a command started with a pty

    def subscribe(self) -> Subscriber:
        sub = Subscriber()
        with self._lock:
            if self.end is not None:
                sub.finish(self.end)
            else:
                self._subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        sub.cancel()
        with self._lock:
            if sub in self._subscribers:
                self._subscribers.remove(sub)

    def publish(self, data: DataEvent) -> None:
        with self._lock:
            subs = list(self._subscribers)
        for sub in subs:
            sub.put(data)

    def finish(self, end: EndEvent) -> None:
        with self._lock:
            self.end = end
            subs, self._subscribers = self._subscribers, []
        for sub in subs:
            sub.finish(end)

    def signal(self, signum: int) -> None:
        if signum in (signal.SIGKILL, signal.SIGTERM):
            self.killed.set()
        try:
            os.killpg(self.pid, signum)  # the command's own group: everything it started
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def write_pty(self, data: bytes) -> None:
        if self.tty is None:
            raise ConnectError("internal", "error writing to tty: tty not assigned to process")
        with self._stdin_lock:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.tty, view) :]
            except OSError as exc:
                raise ConnectError(
                    "internal", f"error writing to tty of process '{self.pid}': {exc.strerror}"
                ) from None

    def resize(self, cols: int, rows: int) -> None:
        if self.tty is None:
            raise ConnectError("internal", "error resizing tty: tty not assigned to process")
        try:
            set_winsize(self.tty, cols, rows)
        except OSError as exc:
            raise ConnectError("internal", f"error resizing tty: {exc.strerror}") from None

    def write_stdin(self, data: bytes) -> None:
        if self.tty is not None:
            raise ConnectError(
                "internal", "error writing to stdin: tty assigned to process — input should be written to the pty"
            )
        with self._stdin_lock:
            stdin = self.popen.stdin
            if stdin is None or stdin.closed:
                raise ConnectError("internal", "error writing to stdin: stdin not enabled or closed")
            try:
                view = memoryview(data)
                while view:  # an unbuffered pipe may take part of a write
                    view = view[os.write(stdin.fileno(), view) :]
            except (BrokenPipeError, ValueError, OSError) as exc:
                raise ConnectError(
                    "internal", f"error writing to stdin of process '{self.pid}': {type(exc).__name__}"
                ) from None

    def close_stdin(self) -> None:
        if self.tty is not None:
            raise ConnectError("unknown", "cannot close stdin for PTY process — send Ctrl+D (0x04) instead")
        self._close_stdin()

    def _close_stdin(self) -> None:
        with self._stdin_lock:
            stdin = self.popen.stdin
            if stdin is not None and not stdin.closed:
                with contextlib.suppress(OSError):
                    stdin.close()


@dataclass
class ProcessTable:
    default_env: dict[str, str] = field(default_factory=dict)
    default_workdir: str | None = None
    max_processes: int = 256
    limits: CommandLimits | None = None  # the guest's cgroup and rlimits for commands (limits.py)
    live: dict[int, Process] = field(default_factory=dict)
    retained: dict[int, tuple[float, Process]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, request: StartRequest, user: User, timeout_s: float | None) -> tuple[Process, Subscriber]:
        config, pty, tag = request.process, request.pty, request.tag
        cmd = config.cmd
        if not cmd:
            raise ConnectError("invalid_argument", "process.cmd is required")
        args = list(config.args or ())
        envs = config.envs or {}
        cwd_in = config.cwd
        stdin = request.stdin is not False  # envd: absent means true (backwards compatibility)
        cwd = expand_and_resolve(cwd_in or "", user, self.default_workdir)
        if not os.path.exists(cwd):
            raise ConnectError("invalid_argument", f"cwd '{cwd}' does not exist")
        env = {
            "PATH": os.environ.get("PATH", DEFAULT_PATH),
            "HOME": user.home,
            "USER": user.name,
            "LOGNAME": user.name,
            **self.default_env,
            **envs,
        }
        creds: dict[str, Any] = {}
        if os.geteuid() == 0:
            if user.uid != 0 or user.gid != 0:
                creds = {"user": user.uid, "group": user.gid, "extra_groups": user.groups()}
        elif user.uid != os.geteuid():
            raise ConnectError("permission_denied", f"cannot run as '{user.name}': the service is not root")
        with self._lock:
            if len(self.live) >= self.max_processes:
                raise ConnectError("resource_exhausted", f"{len(self.live)} processes running (limit)")
        master = slave = None
        streams: dict[str, Any] = {
            "stdin": subprocess.PIPE if stdin else subprocess.DEVNULL,
            "stdout": subprocess.PIPE,
            "stderr": subprocess.PIPE,
        }
        if pty is not None:
            master, slave = os.openpty()
            set_winsize(master, pty.size.cols, pty.size.rows)
            streams = {"stdin": slave, "stdout": slave, "stderr": slave, "preexec_fn": _controlling_tty}
        argv = [cmd, *args]
        gated = self.limits is not None and pty is None  # the pty path keeps its preexec_fn (no gate)
        if gated:
            assert self.limits is not None
            probe = cmd if os.path.isabs(cmd) or "/" not in cmd else os.path.join(cwd, cmd)
            found = shutil.which(probe, path=env["PATH"])
            if found is None:  # as a direct exec would: invalid_argument at Start
                raise ConnectError("invalid_argument", f"error starting process '{' '.join(argv)}': not found")
            argv = self.limits.gated(cmd, os.path.abspath(os.path.join(cwd, found)), args)
        try:
            popen = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                start_new_session=True,  # own session and process group: killpg reaches all it starts
                close_fds=True,
                bufsize=0,
                **streams,
                **creds,
            )
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            if master is not None:
                os.close(master)
            raise ConnectError(
                "invalid_argument", f"error starting process '{' '.join([cmd, *args])}': {exc}"
            ) from None
        finally:
            if slave is not None:
                os.close(slave)
        if gated:
            assert self.limits is not None
            ended = self.limits.confine(popen.pid, user.uid)
            if ended is not None:
                popen.returncode = ended  # reaped already; wait() returns it
        shown = ProcessConfig(cmd, tuple(args) or None, envs or None, cwd_in)  # as given, defaults omitted
        proc = Process(popen.pid, shown, tag, popen, tty=master)
        first = proc.subscribe()  # before any output can be read: the starter sees all of it
        with self._lock:
            self.retained.pop(proc.pid, None)
            self.live[proc.pid] = proc
        self._watch(proc, timeout_s)
        return proc, first

    def _watch(self, proc: Process, timeout_s: float | None) -> None:
        if proc.tty is not None:
            readers = [threading.Thread(target=self._pump, args=(proc, proc.tty, "pty"), daemon=True)]
        else:
            assert proc.popen.stdout is not None and proc.popen.stderr is not None
            readers = [
                threading.Thread(target=self._pump, args=(proc, proc.popen.stdout, "stdout"), daemon=True),
                threading.Thread(target=self._pump, args=(proc, proc.popen.stderr, "stderr"), daemon=True),
            ]
        for t in readers:
            t.start()
        timer: threading.Timer | None = None
        if timeout_s is not None and timeout_s > 0:
            timer = threading.Timer(timeout_s, proc.signal, args=(signal.SIGKILL,))
            timer.daemon = True
            timer.start()

        def wait() -> None:
            returncode = proc.popen.wait()
            for t in readers:
                # like envd, the end comes after the output pipes close; after a kill, descendants that escaped
                # the group must not hold the stream open for ever
                t.join(KILL_GRACE_S if proc.killed.is_set() else None)
            if timer is not None:
                timer.cancel()
            proc._close_stdin()
            proc.finish(end_event(returncode))
            with self._lock:
                if self.live.get(proc.pid) is proc:
                    del self.live[proc.pid]
                self.retained[proc.pid] = (time.monotonic() + RETENTION_S, proc)
                self._expire()

        threading.Thread(target=wait, daemon=True, name=f"wait {proc.pid}").start()

    @staticmethod
    def _pump(proc: Process, pipe: Any, kind: Literal["stdout", "stderr", "pty"]) -> None:
        """Output to subscribers until EOF (a pty master reads EIO once the last slave fd is closed)."""
        fd = pipe if isinstance(pipe, int) else pipe.fileno()
        try:
            while True:
                try:
                    data = os.read(fd, CHUNK)
                except OSError:
                    return
                if not data:
                    return
                proc.publish(DataEvent(kind, data))
        finally:
            with contextlib.suppress(OSError):
                os.close(fd) if isinstance(pipe, int) else pipe.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for pid in [p for p, (until, _) in self.retained.items() if until < now]:
            del self.retained[pid]

    def find(self, selector: ProcessSelector | None, include_ended: bool = False) -> Process:
        pid, tag = (None, None) if selector is None else (selector.pid, selector.tag)
        with self._lock:
            self._expire()
            candidates = list(self.live.values())
            if include_ended:
                candidates += [p for _, p in self.retained.values()]
            if pid is not None:
                for p in candidates:
                    if p.pid == pid:
                        return p
                raise ConnectError("not_found", f"process with pid {pid} not found")
            if tag is not None:
                for p in candidates:
                    if p.tag == tag:
                        return p
                raise ConnectError("not_found", f"process with tag {tag} not found")
        raise ConnectError("unimplemented", "invalid input type: no process selector")

    def list(self) -> ListResponse:
        with self._lock:
            procs = list(self.live.values())
        return ListResponse(tuple(ProcessInfo(p.config, p.pid, p.tag) for p in procs))

    def kill_all(self) -> None:
        with self._lock:
            procs = list(self.live.values())
        for p in procs:
            p.signal(signal.SIGKILL)


def set_winsize(fd: int, cols: int, rows: int) -> None:
    import fcntl
    import struct
    import termios  # only where ptys are used: a pruned guest Python may lack it

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows & 0xFFFF, cols & 0xFFFF, 0, 0))


def _controlling_tty() -> None:
    """In the child, after setsid: make the pty (now fd 0) the controlling terminal, as creack/pty does."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
