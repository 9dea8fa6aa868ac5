"""`cube-workload serve`: the guest's envd-compatible workload service (argparse: the guest has no typer).

  python3 -m cubeaccel.workload serve --unix PATH | --tcp HOST:PORT --token-file FILE [--default-user U]

The access token comes from a file (or CUBE_WORKLOAD_TOKEN), never from the command line, where any process in
the guest could read it. SIGTERM stops serving and kills every running command's process group.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import select
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from cubeaccel.protocol.mux import MAX_PREAMBLE, TOKEN_PREAMBLE, Session, parse_preamble
from cubeaccel.workload import limits
from cubeaccel.workload.app import Workload
from cubeaccel.workload.http1 import Server, SocketListener, log
from cubeaccel.workload.muxchannel import MuxChannel
from cubeaccel.workload.process import ProcessTable

TOKEN_ENV = "CUBE_WORKLOAD_TOKEN"
EOF_RETRY_S = 0.2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cube-workload", description="envd-compatible process and file service")
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="serve envd's protocol on a listener")
    where = srv.add_mutually_exclusive_group(required=True)
    where.add_argument("--unix", metavar="PATH", help="unix socket (created 0600)")
    where.add_argument("--tcp", metavar="HOST:PORT", help="TCP address (tests; port 0 picks one)")
    where.add_argument("--mux-port", metavar="NAME|PATH", help="virtio-serial port carrying the mux framing")
    where.add_argument("--mux-fd", type=int, metavar="FD", help="inherited fd carrying the mux framing (tests)")
    srv.add_argument("--token-file", metavar="FILE", help=f"access token file (else ${TOKEN_ENV})")
    srv.add_argument(
        "--token-from-channel",
        action="store_true",
        help="with --mux-port/--mux-fd: the host sends the token before each session (a restored snapshot's way)",
    )
    srv.add_argument("--default-user", default=None, help="user for calls that name none (default: our own)")
    srv.add_argument("--default-workdir", default=None, help="cwd and base for relative paths (default: home)")
    srv.add_argument("--env-file", metavar="FILE", help="JSON object of environment variables for every command")
    srv.add_argument("--max-processes", type=int, default=256)
    srv.add_argument("--max-connections", type=int, default=512)
    srv.add_argument(
        "--limit-commands",
        action="store_true",
        help="as root in a guest: put every command in a cgroup v2 group with pids/memory limits (limits.py)",
    )
    srv.add_argument("--max-tasks", type=int, default=limits.DEFAULT_MAX_TASKS, help="pids.max of that group")
    srv.add_argument(
        "--restart-marker",
        metavar="FILE",
        help="with --mux-port: a file that exists when a previous run of ours served this port (a restart): "
        "then end the host's stale session at once (a GOAWAY frame) so that it reconnects",
    )
    return parser


def _token(args: argparse.Namespace) -> bytes:
    if args.token_from_channel:
        if args.mux_port is None and args.mux_fd is None:
            raise SystemExit("cube-workload: --token-from-channel needs --mux-port or --mux-fd")
        return os.urandom(32).hex().encode()  # unknowable until each session's preamble replaces it
    if args.token_file:
        token = Path(args.token_file).read_bytes().strip()
    else:
        token = os.environ.pop(TOKEN_ENV, "").strip().encode()  # not inherited by the commands we start
    if not token:
        raise SystemExit(f"cube-workload: an access token is required (--token-file or ${TOKEN_ENV})")
    return token


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    env: dict[str, str] = {}
    if args.env_file:
        loaded = json.loads(Path(args.env_file).read_text())
        if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
            raise SystemExit("cube-workload: --env-file must hold a JSON object of strings")
        env = loaded
    default_user = args.default_user or pwd.getpwuid(os.geteuid()).pw_name
    workload = Workload(
        token=_token(args),
        default_user=default_user,
        default_workdir=args.default_workdir,
        processes=ProcessTable(
            default_env=env,
            max_processes=args.max_processes,
            limits=limits.setup(args.max_tasks) if args.limit_commands else None,
        ),
    )
    if args.mux_port is not None or args.mux_fd is not None:
        return _serve_mux(args, workload)
    if args.unix:
        listener = SocketListener.unix(args.unix)
    else:
        host, _, port = args.tcp.rpartition(":")
        listener = SocketListener.tcp(host or "127.0.0.1", int(port))
    server = Server(listener, workload, args.max_connections)

    def stop(signum: int, frame: FrameType | None) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log(f"serving on {listener.address}")
    try:
        server.serve_forever()
    finally:
        workload.processes.kill_all()
    return 0


def _serve_mux(args: argparse.Namespace, workload: Workload) -> int:
    """One mux session at a time on the channel; on a port, a new one after the host goes away and comes back."""
    if args.mux_fd is not None:
        fd, reconnect, where = args.mux_fd, False, f"fd {args.mux_fd}"
    else:
        from cubeaccel.guest.virtio_port import open_port, resolve_port  # the same lookup as cube-agent

        path = resolve_port(args.mux_port, wait_s=10.0)
        fd, reconnect, where = open_port(path), True, str(path)
        if args.restart_marker:
            announce_restart(fd, Path(args.restart_marker))
    stopped = threading.Event()
    current: list[Server] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        stopped.set()
        for server in current:
            server.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log(f"serving on mux {where}")
    try:
        while not stopped.is_set():
            if args.token_from_channel:
                token = read_preamble(fd, stopped)
                if token is None:
                    if not reconnect:
                        break
                    stopped.wait(EOF_RETRY_S)
                    continue
                workload.token = token
            server = Server(MuxChannel(fd, fd, client=False), workload, args.max_connections)
            current[:] = [server]
            server.serve_forever()
            if not reconnect:
                break
            if not args.token_from_channel:  # else read_preamble waits, only when the host is really away (EOF)
                stopped.wait(EOF_RETRY_S)  # the host side is away: a virtio port reads EOF until it is back
    finally:
        workload.processes.kill_all()
    return 0


def announce_restart(fd: int, marker: Path) -> None:
    """After a restart the host still runs the session of our previous run (a virtio port shows it no close):
    a GOAWAY (RESET on stream 0) ends it there, and the host reconnects with a new preamble. On the first run
    there is no stale session; we only leave the marker."""
    if marker.exists():
        session = Session(client=False)
        session.go_away()
        with contextlib.suppress(OSError):
            os.write(fd, session.data_to_send())
        log("restarted: told the host to start a new session")
    else:
        with contextlib.suppress(OSError):
            marker.touch()


def read_preamble(fd: int, stopped: threading.Event) -> bytes | None:
    """The token line the host writes before a session's first frame, read a byte at a time so that no frame
    byte is taken from the channel; None on EOF (the host is away). What precedes the preamble's prefix (frames
    of a session the host sent before it learnt that ours ended) is skipped; a malformed line is None."""
    window = bytearray()
    while not stopped.is_set():
        try:
            b = os.read(fd, 1)
        except BlockingIOError:
            select.select([fd], [], [], EOF_RETRY_S)
            continue
        except OSError:
            return None
        if not b:
            return None
        window += b
        if len(window) <= len(TOKEN_PREAMBLE):
            if not TOKEN_PREAMBLE.startswith(bytes(window)):
                del window[:1]
                while window and not TOKEN_PREAMBLE.startswith(bytes(window)):
                    del window[:1]
            continue
        if b == b"\n":
            return parse_preamble(bytes(window[:-1]))
        if len(window) > MAX_PREAMBLE:
            return None
    return None


if __name__ == "__main__":
    sys.exit(main())
