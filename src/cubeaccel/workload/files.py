"""Files as envd serves them: `filesystem.Filesystem` RPCs, `GET /files` and `POST /files` (raw or multipart).

Uploads and downloads stream in 64 KiB pieces (a 5 GiB file costs what a 5 KiB one does in memory); multipart
is parsed incrementally, never buffered. Entry fields follow envd's EntryInfo: for a symlink, `type` and `mode`
are the target's, `permissions` is Go's FileMode string of the link itself.
"""

from __future__ import annotations

import contextlib
import errno
import mimetypes
import os
import stat
import zlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from email.message import Message
from typing import Any

from cubeaccel.protocol.envd_filesystem import EntryInfo, EntryResponse, ListDirResponse
from cubeaccel.protocol.proto_json import Empty
from cubeaccel.workload.connect import ConnectError
from cubeaccel.workload.http1 import HttpError
from cubeaccel.workload.users import User, chown, ensure_dirs, owner_names

PIECE = 64 * 1024
MAX_LIST_ENTRIES = 100_000
MAX_PART_HEADERS = 16 * 1024


def go_mode_string(mode: int) -> str:
    """Go's os.FileMode.String() for an lstat mode: type letters in Go's order (`dalTLDpSugct?`), then rwx."""
    letters = ""
    fmt = stat.S_IFMT(mode)
    if fmt == stat.S_IFDIR:
        letters += "d"
    if fmt == stat.S_IFLNK:
        letters += "L"
    if fmt in (stat.S_IFBLK, stat.S_IFCHR):
        letters += "D"
    if fmt == stat.S_IFIFO:
        letters += "p"
    if fmt == stat.S_IFSOCK:
        letters += "S"
    if mode & stat.S_ISUID:
        letters += "u"
    if mode & stat.S_ISGID:
        letters += "g"
    if fmt == stat.S_IFCHR:
        letters += "c"
    if mode & stat.S_ISVTX:
        letters += "t"
    rwx = "".join(ch if mode & (1 << (8 - i)) else "-" for i, ch in enumerate("rwxrwxrwx"))
    return (letters or "-") + rwx


def timestamp(ns: int) -> str:
    """google.protobuf.Timestamp in protojson's form: RFC 3339, UTC, 0/3/6/9 fractional digits."""
    secs, nanos = divmod(ns, 1_000_000_000)
    base = datetime.fromtimestamp(secs, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    if nanos == 0:
        frac = ""
    elif nanos % 1_000_000 == 0:
        frac = f".{nanos // 1_000_000:03d}"
    elif nanos % 1000 == 0:
        frac = f".{nanos // 1000:06d}"
    else:
        frac = f".{nanos:09d}"
    return f"{base}{frac}Z"


FILE_TYPE = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "link": "FILE_TYPE_SYMLINK"}


def _kind(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return FILE_TYPE["file"]
    if stat.S_ISDIR(mode):
        return FILE_TYPE["dir"]
    if stat.S_ISLNK(mode):
        return FILE_TYPE["link"]
    return None


def entry_info(path: str) -> EntryInfo:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ConnectError("not_found", f"file not found: lstat {path}: no such file or directory") from None
    except OSError as exc:
        raise ConnectError("internal", f"error getting file info: {exc.strerror}") from None
    kind, mode = _kind(st.st_mode), stat.S_IMODE(st.st_mode) & 0o777
    target: str | None = None
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.path.realpath(path, strict=True)
            tst = os.stat(target)
            kind, mode = _kind(tst.st_mode), stat.S_IMODE(tst.st_mode) & 0o777
        except OSError:
            target = target or path  # envd: an unresolvable link reports itself as its target
            kind, mode = None, 0
    owner, group = owner_names(st.st_uid, st.st_gid)
    return EntryInfo(
        name=os.path.basename(path.rstrip("/")) or "/",
        path=path,
        type=kind,
        size=st.st_size,
        mode=mode,
        permissions=go_mode_string(st.st_mode),
        owner=owner,
        group=group,
        modified_time=timestamp(st.st_mtime_ns),
        symlink_target=target,
        metadata=read_metadata(path),
    )


# ---- file metadata (envd 0.6.2): `X-Metadata-<key>` on upload, `user.e2b.<key>` xattrs, EntryInfo.metadata ----

METADATA_XATTR = "user.e2b."
# Where a filesystem has no user xattrs (tmpfs before Linux 6.6: the guest's own root), envd keeps no metadata;
# this service, which runs as root, keeps it in the trusted namespace instead, so the SDK's metadata works on
# the guest's disk-less root. Read from both; the user namespace wins (a user's own `setfattr`).
FALLBACK_XATTR = "trusted.e2b."
METADATA_HEADER = "x-metadata-"
_NO_XATTRS = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


def read_metadata(path: str) -> dict[str, str]:
    """The file's `user.e2b.*` (then `trusted.e2b.*`) xattrs, prefix stripped (other xattrs are not metadata);
    {} where the filesystem has none."""
    try:
        names = os.listxattr(path)
        out: dict[str, str] = {}
        for prefix in (FALLBACK_XATTR, METADATA_XATTR):
            for n in sorted(x for x in names if x.startswith(prefix)):
                out[n[len(prefix) :]] = os.getxattr(path, n).decode("utf-8", "replace")
        return dict(sorted(out.items()))
    except OSError:
        return {}


def metadata_of(headers: Any) -> dict[str, str]:
    """`X-Metadata-*` request headers, keys lowercased (envd's extractMetadataHeaders; the first value wins)."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        low = name.lower()
        if low.startswith(METADATA_HEADER) and len(low) > len(METADATA_HEADER):
            out.setdefault(low[len(METADATA_HEADER) :], str(value))
    return out


def write_metadata(fd: int, metadata: dict[str, str]) -> None:
    """Replace the file's whole metadata set (O_TRUNC keeps a prior upload's xattrs, so the old set goes first),
    in the user namespace, else the trusted one. A filesystem with neither keeps the body and no metadata, as
    envd does; the reply reads back what was stored, so it never claims metadata that was not kept."""
    try:
        for name in os.listxattr(fd):
            if name.startswith((METADATA_XATTR, FALLBACK_XATTR)):
                os.removexattr(fd, name)
        for prefix in (METADATA_XATTR, FALLBACK_XATTR):
            try:
                for key, value in metadata.items():
                    os.setxattr(fd, prefix + key, value.encode())
                return
            except OSError as exc:
                if exc.errno not in _NO_XATTRS and not (exc.errno == errno.EPERM and prefix == FALLBACK_XATTR):
                    raise
    except OSError as exc:
        if exc.errno in _NO_XATTRS:
            return
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.E2BIG, errno.ERANGE):
            raise HttpError(507, f"not enough space for file metadata: {exc.strerror}") from None
        raise HttpError(500, f"error writing file metadata: {exc.strerror}") from None


def stat_rpc(path: str) -> EntryResponse:
    return EntryResponse(entry_info(path))


def list_dir(requested: str, depth: int) -> ListDirResponse:
    depth = depth or 1
    try:
        resolved = os.path.realpath(requested, strict=True)
    except FileNotFoundError:
        raise ConnectError("not_found", f"path not found: {requested}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConnectError("failed_precondition", f"cyclic symlink or chain >255 links at {requested!r}") from None
        raise ConnectError("internal", f"error resolving symlink: {exc.strerror}") from None
    if not os.path.isdir(resolved):
        raise ConnectError("invalid_argument", f"path is not a directory: {resolved}")
    entries: list[EntryInfo] = []

    def walk(directory: str, rel: str, level: int) -> None:
        try:
            names = sorted(os.listdir(directory))
        except OSError as exc:
            raise ConnectError("internal", f"error reading directory {resolved}: {exc.strerror}") from None
        for name in names:
            full, relpath = os.path.join(directory, name), os.path.join(rel, name) if rel else name
            try:
                entry = entry_info(full)
            except ConnectError as err:
                if err.code == "not_found":
                    continue  # gone between listdir and lstat
                raise
            entries.append(replace(entry, path=os.path.join(requested, relpath)))
            if len(entries) > MAX_LIST_ENTRIES:
                raise ConnectError("resource_exhausted", f"more than {MAX_LIST_ENTRIES} entries; ask for less depth")
            if level < depth and stat.S_ISDIR(os.lstat(full).st_mode):  # links are listed, never followed
                walk(full, relpath, level + 1)

    walk(resolved, "", 1)
    return ListDirResponse(tuple(entries))


def make_dir(path: str, user: User) -> EntryResponse:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise ConnectError("internal", f"error getting file info: {exc.strerror}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ConnectError("already_exists", f"directory already exists: {path}")
        raise ConnectError("invalid_argument", f"path already exists but it is not a directory: {path}")
    _ensure(path, user)
    return EntryResponse(entry_info(path))


def _ensure(path: str, user: User) -> None:
    try:
        ensure_dirs(path, user)
    except OSError as exc:
        raise ConnectError("internal", f"failed to create directory: {exc.strerror}") from None


def move(source: str, destination: str, user: User) -> EntryResponse:
    _ensure(os.path.dirname(destination), user)
    try:
        os.rename(source, destination)
    except FileNotFoundError:
        raise ConnectError("not_found", f"source file not found: rename {source} {destination}") from None
    except OSError as exc:
        raise ConnectError("internal", f"error renaming: {exc.strerror}") from None
    return EntryResponse(entry_info(destination))


def remove(path: str) -> Empty:
    """os.RemoveAll: a missing path is not an error; a directory goes with everything in it (links not followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Empty()
    try:
        if stat.S_ISDIR(st.st_mode):
            import shutil

            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConnectError("internal", f"error removing file or directory: {exc.strerror}") from None
    return Empty()


# ---- /files --------------------------------------------------------------------------------------------------


def open_download(path: str) -> tuple[int, Any, str]:
    """(size, open file, content type) for GET /files; HttpError with envd's status and message otherwise."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise HttpError(404, f"path '{path}' does not exist") from None
    except OSError as exc:
        raise HttpError(500, f"error checking if path exists '{path}': {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise HttpError(400, f"path '{path}' is a directory")
    try:
        f = open(path, "rb")  # noqa: SIM115 - streamed by the caller, closed there
    except OSError as exc:
        raise HttpError(500, f"error opening file '{path}': {exc.strerror}") from None
    ctype = mimetypes.guess_type(path)[0] or "application/octet-stream"
    return st.st_size, f, ctype


def write_file(path: str, pieces: Iterator[bytes], user: User, metadata: dict[str, str] | None = None) -> None:
    """envd processFile: parents created (owned by the user), truncated in place, ENOSPC -> 507, then the
    metadata set replaced (`write_metadata`)."""
    try:
        ensure_dirs(os.path.dirname(path), user)
    except (OSError, ConnectError) as exc:
        raise HttpError(500, f"error ensuring directories: {exc}") from None
    if os.path.isdir(path):
        raise HttpError(400, f"path is a directory: {path}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise HttpError(507, "not enough inodes available") from None
        raise HttpError(500, f"error opening file: {exc.strerror}") from None
    try:
        with contextlib.suppress(OSError):
            chown(path, user)
        for piece in pieces:
            view = memoryview(piece)
            while view:
                view = view[os.write(fd, view) :]
        write_metadata(fd, metadata or {})
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise HttpError(507, "not enough disk space available") from None
        raise HttpError(500, f"error writing file: {exc.strerror}") from None
    finally:
        os.close(fd)


def decoded(read: Callable[[int], bytes], encoding: str) -> Callable[[int], bytes]:
    """The request body as a reader, gunzipped on the fly if Content-Encoding says gzip."""
    encoding = encoding.split(";")[0].strip().lower()
    if encoding in ("", "identity"):
        return read
    if encoding != "gzip":
        raise HttpError(400, f"error decompressing request body: unsupported Content-Encoding: {encoding}")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)

    def gunzip(n: int) -> bytes:
        while True:
            if inflater.unconsumed_tail:
                out = inflater.decompress(inflater.unconsumed_tail, n)
            else:
                raw = read(PIECE)
                if not raw:
                    if not inflater.eof:
                        raise HttpError(400, "error decompressing request body: truncated gzip stream")
                    return b""
                try:
                    out = inflater.decompress(raw, n)
                except zlib.error as exc:
                    raise HttpError(400, f"error decompressing request body: {exc}") from None
            if out:
                return out
            if inflater.eof and not inflater.unconsumed_tail:
                return b""

    return gunzip


def pieces_of(read: Callable[[int], bytes]) -> Iterator[bytes]:
    while True:
        data = read(PIECE)
        if not data:
            return
        yield data


class Multipart:
    """Streaming multipart/form-data: `parts()` yields (headers, reader); a part's bytes are never all held."""

    def __init__(self, read: Callable[[int], bytes], boundary: str) -> None:
        self._read = read
        self._delim = b"\r\n--" + boundary.encode("latin-1")
        self._buf = bytearray(b"\r\n")  # so the first delimiter looks like every other one
        self._eof = False

    def _fill(self) -> None:
        data = self._read(PIECE)
        if data:
            self._buf += data
        else:
            self._eof = True

    def parts(self) -> Iterator[tuple[Message, Callable[[int], bytes]]]:
        self._skip_to_delimiter()
        while True:
            while len(self._buf) < 2 and not self._eof:
                self._fill()
            if self._buf.startswith(b"--"):
                return
            headers = self._headers()
            part = _PartReader(self)
            yield headers, part.read
            part.drain()

    def _skip_to_delimiter(self) -> None:
        while True:
            idx = self._buf.find(self._delim)
            if idx >= 0:
                del self._buf[: idx + len(self._delim)]
                return
            if self._eof:
                raise HttpError(400, "error parsing multipart form: no boundary found")
            del self._buf[: max(0, len(self._buf) - len(self._delim))]
            self._fill()

    def _headers(self) -> Message:
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(self._buf) > MAX_PART_HEADERS or self._eof:
                raise HttpError(400, "error reading form: bad part headers")
            self._fill()
        block, self._buf = bytes(self._buf[:end]), self._buf[end + 4 :]
        msg = Message()
        for line in block.decode("utf-8", "replace").split("\r\n"):
            if ":" in line:
                name, value = line.split(":", 1)
                msg[name.strip()] = value.strip()
        return msg

    def read_part(self, n: int) -> tuple[bytes, bool]:
        """Up to n bytes of the current part, and whether the part ended here."""
        while True:
            idx = self._buf.find(self._delim)
            if idx >= 0:
                take = min(n, idx)
                data = bytes(self._buf[:take])
                if take == idx:
                    del self._buf[: idx + len(self._delim)]
                    return data, True
                del self._buf[:take]
                return data, False
            safe = len(self._buf) - len(self._delim) + 1
            if safe > 0:
                take = min(n, safe)
                data = bytes(self._buf[:take])
                del self._buf[:take]
                return data, False
            if self._eof:
                raise HttpError(400, "error reading form: body ended inside a part")
            self._fill()


class _PartReader:
    def __init__(self, mp: Multipart) -> None:
        self._mp = mp
        self._done = False

    def read(self, n: int) -> bytes:
        while not self._done:
            data, self._done = self._mp.read_part(n)
            if data:
                return data
        return b""

    def drain(self) -> None:
        while self.read(PIECE):
            pass
