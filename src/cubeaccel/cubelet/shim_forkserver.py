"""Cubelet's side of the shim fork server (shim/forkserver.py): start it, ask it for a shim, or say why not.

Every answer other than a pid means "spawn this shim the ordinary way": the fork server only ever makes a start
faster. `cubelet serve` starts it with the host's initialization; a start that finds it gone is spawned and
starts it again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
from pathlib import Path

from pydantic import ValidationError

from cubeaccel.host.service import proctitle
from cubeaccel.host.service.childenv import component_env
from cubeaccel.host.service.unix_path import connect_path
from cubeaccel.wire.shim_launch import MAX_REQUEST_BYTES, SOCKET_NAME, ShimLaunchReply, ShimLaunchRequest

REPLY_TIMEOUT_S = 15.0  # the fork server waits up to 10 s for its child to show its argv
_log = logging.getLogger("cubeaccel.cubelet.shim_forkserver")


class ForkServer:
    def __init__(self, directory: Path, python: str) -> None:
        self.dir = directory
        self.python = python
        self.socket = directory / SOCKET_NAME
        self._proc: subprocess.Popen[bytes] | None = None
        self.last_refusal: str | None = None  # why the last start was spawned instead (logs, tests)
        self.unanswered = False  # the last request was sent and not answered: look for the shim before spawning

    def ensure_started(self) -> None:
        """Start it when it is not running. Never waits for it to be ready: the caller spawns meanwhile."""
        if self._proc is not None and self._proc.poll() is None:
            return
        with open(self.dir / "forkserver.log", "ab") as log:
            # stdin is our pipe: when this Cubelet exits, the fork server reads EOF and exits too.
            self._proc = subprocess.Popen(
                [self.python, "-m", "cubeaccel.shim", "serve", "--dir", str(self.dir), *proctitle.room_args()],
                stdin=subprocess.PIPE,
                env=component_env(),  # never the Cubelet's whole environment (issue 30 #6)
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # same cwd and environment as a spawned shim: it imports the same code
            )

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def launch(
        self, argv: list[str], log_fd: int, workload_token: str | None, reply_timeout_s: float = REPLY_TIMEOUT_S
    ) -> int | None:
        """The forked shim's pid, already showing `argv` in /proc; None (and `last_refusal`) when it was not
        made — or when no answer came, so the caller looks for the shim by its argv before spawning one."""
        if self.pid is None:
            return self._refused("not running")
        body = ShimLaunchRequest(argv=tuple(argv), env=component_env(), cwd=os.getcwd()).model_dump(mode="json")
        body["workload_token"] = workload_token  # a SecretStr dumps masked: this request is where it travels
        data = json.dumps(body).encode()
        if len(data) > MAX_REQUEST_BYTES:
            return self._refused(f"request of {len(data)} bytes")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(reply_timeout_s)
            try:
                s.connect(connect_path(self.socket))
            except OSError as e:  # not listening yet (just started), or gone: nothing was asked
                return self._refused(f"{type(e).__name__}: {e}")
            try:
                sent = socket.send_fds(s, [data], [log_fd])
                s.sendall(data[sent:])
                s.shutdown(socket.SHUT_WR)
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
                    if len(reply) > 65536:
                        raise OSError("reply too large")
            except OSError as e:
                # Asked, but no answer: a shim may or may not have been forked. Kill the fork server; a child
                # that had not shown its argv yet cannot start (its ready pipe breaks), one that had is findable.
                self._abandon()
                return self._refused(f"no reply: {type(e).__name__}: {e}", asked=True)
        try:
            answer = ShimLaunchReply.model_validate_json(reply)
        except ValidationError as e:  # not the server we started: as good as no answer
            self._abandon()
            return self._refused(f"unreadable reply: {e.errors()[:1]}", asked=True)
        if answer.pid is None:
            return self._refused(answer.error or "no pid")
        self.last_refusal, self.unanswered = None, False
        return answer.pid

    def _refused(self, why: str, asked: bool = False) -> int | None:
        self.last_refusal, self.unanswered = why, asked
        _log.info("shim fork server not used: %s", why)
        return None

    def _abandon(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
            self._proc = None

    def close(self) -> None:
        """Let it go (it exits on EOF); shims it forked keep running."""
        if self._proc is not None:
            if self._proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self._proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
            self._proc = None
