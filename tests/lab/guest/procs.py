"""Holder processes and PID-namespace helpers for lab scenarios (inside the guest; stdlib only)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import vfio_ioctl

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
_libc = ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> None:
    if _libc.unshare(flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"unshare: {os.strerror(e)}")


def _mount(src: bytes, target: bytes, fstype: bytes | None, flags: int) -> None:
    if _libc.mount(src, target, fstype, flags, None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {target!r}: {os.strerror(e)}")


def _own_proc() -> None:
    """In a fresh mount + PID namespace: a private /proc that shows only this namespace's processes."""
    _mount(b"none", b"/", None, MS_REC | MS_PRIVATE)
    _mount(b"proc", b"/proc", b"proc", 0)


@dataclass
class HolderProc:
    pid: int  # in the guest's initial PID namespace
    parent: int | None = None  # the in-between process of a namespaced holder

    def stop(self) -> None:
        for pid in (self.pid, self.parent):
            if pid is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in (self.parent, self.pid):
            if pid is None:
                continue
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _hold(bdf: str, group: int, device_fd_only: bool, w: int) -> None:
    try:
        opened = vfio_ioctl.open_device(bdf, group)
        if device_fd_only:
            opened.close_group_and_container()
        os.write(w, f"ok {os.getpid()}\n".encode())
    except OSError as e:
        os.write(w, f"err {e}\n".encode())
        os._exit(1)
    os.close(w)
    while True:
        signal.pause()


def spawn_holder(bdf: str, group: int, device_fd_only: bool = False, own_pidns: bool = False) -> HolderProc:
    """A process that opens the device like a VMM and keeps it open until stopped."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            if own_pidns:
                _unshare(CLONE_NEWPID | CLONE_NEWNS)
                inner = os.fork()
                if inner == 0:
                    _own_proc()
                    _hold(bdf, group, device_fd_only, w)
                os.write(w, f"pid {inner}\n".encode())
                os.waitpid(inner, 0)
                os._exit(0)
            _hold(bdf, group, device_fd_only, w)
        finally:
            os._exit(2)
    os.close(w)
    with os.fdopen(r) as f:
        lines = [f.readline().strip()]
        if own_pidns:
            lines.append(f.readline().strip())
    status = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in lines if " " in ln}
    if "ok" not in status:
        HolderProc(pid).stop()
        raise OSError(f"holder failed: {lines}")
    if own_pidns:
        return HolderProc(int(status["pid"]), parent=pid)
    return HolderProc(pid)


def in_new_pidns(fn: Callable[[], Any]) -> Any:
    """Run `fn` as PID 1 of a new PID namespace with its own /proc (what a containerised Cubelet sees)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _unshare(CLONE_NEWPID | CLONE_NEWNS)
            inner = os.fork()
            if inner == 0:
                try:
                    _own_proc()
                    out = {"ok": True, "value": fn(), "pid_in_ns": os.getpid()}
                except BaseException as e:
                    out = {"ok": False, "error": repr(e)}
                os.write(w, json.dumps(out, default=str).encode())
                os._exit(0)
            os.waitpid(inner, 0)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = json.loads(data)
    if not out["ok"]:
        raise RuntimeError(f"in new pid namespace: {out['error']}")
    return out["value"]


def visible_pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]
