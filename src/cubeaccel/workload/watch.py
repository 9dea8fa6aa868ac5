"""Directory watches as envd serves them (`WatchDir`, `CreateWatcher`/`GetWatcherEvents`/`RemoveWatcher`).

inotify through ctypes (the guest is Linux and its pruned Python keeps ctypes; rootfs.py checks it), not polling:
a polling scan cannot tell a create from a create-then-write, and the SDK's tests count events. The events and
their order are fsnotify's, which envd uses: one inotify event becomes Create (IN_CREATE, IN_MOVED_TO), Rename
(IN_MOVED_FROM, IN_MOVE_SELF), Chmod (IN_ATTRIB), Write (IN_MODIFY), Remove (IN_DELETE, IN_DELETE_SELF), in that
order; names are relative to the watched directory. A recursive watch adds every directory below, and a
directory created later as soon as its IN_CREATE is read; what it already holds by then is reported as envd's
recursive fsnotify would have seen it (Create, and Write for a non-empty file).

A thread per watcher reads its inotify descriptor as events come (so a new directory is watched at once), and
every read of events drains the descriptor first, so an event the kernel queued before the request is never
missed. An overflowed kernel queue ends the watch with envd's error.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import select
import stat
import struct
import threading
from dataclasses import dataclass, field

from cubeaccel.protocol.envd_filesystem import FilesystemEvent
from cubeaccel.workload.connect import ConnectError
from cubeaccel.workload.files import entry_info

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ISDIR = 0x40000000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = 0o2000000
WATCH_MASK = IN_MOVED_TO | IN_MOVED_FROM | IN_CREATE | IN_ATTRIB | IN_MODIFY | IN_MOVE_SELF | IN_DELETE | IN_DELETE_SELF
EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name

# fsnotify's order of operations within one event, and envd's enum names for them.
OPS = (
    (IN_CREATE | IN_MOVED_TO, "EVENT_TYPE_CREATE"),
    (IN_MOVED_FROM | IN_MOVE_SELF, "EVENT_TYPE_RENAME"),
    (IN_ATTRIB, "EVENT_TYPE_CHMOD"),
    (IN_MODIFY, "EVENT_TYPE_WRITE"),
    (IN_DELETE | IN_DELETE_SELF, "EVENT_TYPE_REMOVE"),
)
WITH_ENTRY = {"EVENT_TYPE_CREATE", "EVENT_TYPE_WRITE", "EVENT_TYPE_CHMOD"}  # envd's opCarriesEntry
MAX_WATCHERS = 64  # per service: each holds an inotify instance and a thread
MAX_PENDING = 100_000  # events kept for a polling watcher that is not polled; then it fails as an overflow
OVERFLOW = "watcher error: fsnotify: queue or buffer overflow"
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse", "9p", "ceph", "glusterfs"}


class _Inotify:
    """The three libc calls, loaded once."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.init1 = libc.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.add_watch = libc.inotify_add_watch
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.rm_watch = libc.inotify_rm_watch
        self.rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]


_LIBC: _Inotify | None = None


def _libc() -> _Inotify:
    global _LIBC
    if _LIBC is None:
        _LIBC = _Inotify()
    return _LIBC


def watch_path_checks(path: str, allow_network_mounts: bool) -> None:
    """envd's checks before a watch starts: exists (`not_found`), a directory, not a network mount."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConnectError("not_found", f"path {path} not found: stat {path}: no such file or directory") from None
    except OSError as exc:
        raise ConnectError("internal", f"error statting path {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConnectError("invalid_argument", f"path {path} not a directory")
    if not allow_network_mounts and _fs_type(path) in NETWORK_FS:
        raise ConnectError("invalid_argument", f"cannot watch path on network filesystem: {path}")


def _fs_type(path: str) -> str:
    """The filesystem type of the longest mount point above `path` (/proc/self/mounts)."""
    best, kind = "", ""
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            mnt = parts[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2].split(".")[0]
    return kind


@dataclass
class Watcher:
    path: str
    recursive: bool
    include_entry: bool
    _fd: int = -1
    _wake: tuple[int, int] = (-1, -1)
    _dirs: dict[int, str] = field(default_factory=dict)  # watch descriptor -> directory
    _events: list[FilesystemEvent] = field(default_factory=list)
    _error: ConnectError | None = None
    _closed: bool = False
    _cv: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        lib = _libc()
        fd = lib.init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise ConnectError("internal", f"error creating watcher: {os.strerror(err)}")
        self._fd = fd
        try:
            self._add_tree(self.path, report=False)
        except BaseException:
            os.close(fd)
            raise
        self._wake = os.pipe()
        threading.Thread(target=self._run, daemon=True, name=f"watch {self.path}").start()

    # ---- watches -----------------------------------------------------------------------------------------------
    def _add(self, directory: str) -> bool:
        wd = _libc().add_watch(self._fd, os.fsencode(directory), WATCH_MASK | IN_ONLYDIR)
        if wd < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOENT, errno.ENOTDIR) and directory != self.path:
                return False  # gone again before we could watch it
            raise ConnectError("internal", f"error adding path {directory} to watcher: {os.strerror(err)}")
        self._dirs[wd] = directory
        return True

    def _add_tree(self, top: str, report: bool) -> None:
        """Watch `top` (and, recursively, what is below). `report`: a directory that appeared while watched —
        what it holds already is reported as the events its own watch would have given."""
        if not self._add(top) or not self.recursive:
            return
        try:
            entries = sorted(os.scandir(top), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            if report:
                self._emit(IN_CREATE, e.path)
                with contextlib.suppress(OSError):
                    if e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_size > 0:
                        self._emit(IN_MODIFY, e.path)
            with contextlib.suppress(OSError):
                if e.is_dir(follow_symlinks=False):
                    self._add_tree(e.path, report)

    # ---- events ------------------------------------------------------------------------------------------------
    def _emit(self, mask: int, full: str) -> None:
        for bits, kind in OPS:
            if not mask & bits:
                continue
            entry = None
            if self.include_entry and kind in WITH_ENTRY:
                with contextlib.suppress(ConnectError):  # best effort, as envd: gone again is no entry
                    entry = entry_info(full)
            self._events.append(FilesystemEvent(os.path.relpath(full, self.path), kind, entry))
        if len(self._events) > MAX_PENDING and self._error is None:
            self._error = ConnectError("internal", OVERFLOW)

    def _drain(self) -> None:
        """Every event the kernel holds for us, into `_events` (the caller holds `_cv`)."""
        while not self._closed and self._error is None:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return
            except OSError as exc:
                self._error = ConnectError("internal", f"watcher error: {exc.strerror}")
                return
            at = 0
            while at + EVENT.size <= len(data):
                wd, mask, _cookie, length = EVENT.unpack_from(data, at)
                raw = data[at + EVENT.size : at + EVENT.size + length].split(b"\0", 1)[0]
                at += EVENT.size + length
                self._one(wd, mask, os.fsdecode(raw))

    def _one(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            self._error = ConnectError("internal", OVERFLOW)
            return
        directory = self._dirs.get(wd)
        if directory is None:
            return
        if mask & IN_IGNORED:
            del self._dirs[wd]
            return
        full = os.path.join(directory, name) if name else directory
        if not name and directory != self.path:
            return  # a watched subdirectory's own event: its parent's watch reports it by name (fsnotify)
        self._emit(mask, full)
        if self.recursive and name and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
            self._add_tree(full, report=True)

    def _run(self) -> None:
        poller = select.poll()  # not select(): a busy guest's descriptors may pass FD_SETSIZE
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake[0], select.POLLIN)
        while True:
            try:
                ready = {fd for fd, _ in poller.poll()}
            except (OSError, ValueError):
                return
            with self._cv:
                if self._closed:
                    return
                if self._fd in ready:
                    before = len(self._events)
                    self._drain()
                    if len(self._events) != before or self._error is not None:
                        self._cv.notify_all()
                if self._error is not None:
                    return

    def take(self, wait_s: float = 0.0) -> list[FilesystemEvent]:
        """Events since the last take; waits up to `wait_s` for one. A failed watch raises its error."""
        with self._cv:
            self._drain()
            if not self._events and self._error is None and wait_s > 0:
                self._cv.wait(wait_s)
                self._drain()
            if self._error is not None:
                raise self._error
            events, self._events = self._events, []
            return events

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        with contextlib.suppress(OSError):
            os.write(self._wake[1], b"x")
        for fd in (self._fd, *self._wake):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class WatcherTable:
    """The polling form's watchers, by id (`w` + random hex, as envd's `w<id>`)."""

    max_watchers: int = MAX_WATCHERS
    _live: dict[str, Watcher] = field(default_factory=dict)
    _streams: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _room(self) -> None:
        if len(self._live) + self._streams >= self.max_watchers:
            raise ConnectError("resource_exhausted", f"{self.max_watchers} watchers open (limit)")

    def create(self, path: str, recursive: bool, include_entry: bool) -> str:
        with self._lock:
            self._room()
            watcher_id = "w" + os.urandom(8).hex()
            self._live[watcher_id] = Watcher(path, recursive, include_entry)
        return watcher_id

    def find(self, watcher_id: str) -> Watcher:
        with self._lock:
            found = self._live.get(watcher_id)
        if found is None:
            raise ConnectError("not_found", f"watcher with id {watcher_id} not found")
        return found

    def remove(self, watcher_id: str) -> None:
        with self._lock:
            found = self._live.pop(watcher_id, None)
        if found is None:
            raise ConnectError("not_found", f"watcher with id {watcher_id} not found")
        found.close()

    def open_stream(self, path: str, recursive: bool, include_entry: bool) -> Watcher:
        """A watcher for one `WatchDir` stream; give it back with `close_stream`."""
        with self._lock:
            self._room()
            watcher = Watcher(path, recursive, include_entry)
            self._streams += 1
        return watcher

    def close_stream(self, watcher: Watcher) -> None:
        watcher.close()
        with self._lock:
            self._streams -= 1

    def close_all(self) -> None:
        with self._lock:
            live, self._live = list(self._live.values()), {}
        for w in live:
            w.close()
