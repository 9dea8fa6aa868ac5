"""envd's filesystem service messages (e2b-dev/infra packages/envd/spec/filesystem/filesystem.proto) and the
entry of `POST /files`'s reply, as the guest's workload service writes them and a client reads them
(`proto_json.py` for how).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cubeaccel.protocol import proto_json as pj
from cubeaccel.protocol.proto_json import Json

FILE_TYPES = ("FILE_TYPE_FILE", "FILE_TYPE_DIRECTORY", "FILE_TYPE_SYMLINK")


@dataclass(frozen=True)
class EntryInfo:
    """`type` None: none of FILE_TYPES (a device, a dangling link). `modified_time` as protojson writes a
    Timestamp (RFC 3339, UTC). `permissions`, `owner`, `group` and `modified_time` are always written, as envd's
    are always set."""

    name: str
    path: str
    type: str | None = None
    size: int = 0
    mode: int = 0
    permissions: str = ""
    owner: str = ""
    group: str = ""
    modified_time: str = ""
    symlink_target: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"name": self.name}
        if self.type is not None:
            out["type"] = self.type
        out["path"] = self.path
        if self.size:
            out["size"] = str(self.size)  # int64
        if self.mode:
            out["mode"] = self.mode
        out.update(permissions=self.permissions, owner=self.owner, group=self.group)
        out["modifiedTime"] = self.modified_time
        if self.symlink_target is not None:
            out["symlinkTarget"] = self.symlink_target
        if self.metadata:
            out["metadata"] = dict(self.metadata)
        return out

    @classmethod
    def from_json(cls, msg: Json) -> EntryInfo:
        kind = pj.get(msg, "type")
        return cls(
            name=pj.get_str(msg, "name"),
            path=pj.get_str(msg, "path"),
            type=None if kind in (None, "FILE_TYPE_UNSPECIFIED", 0) else pj.get_str(msg, "type"),
            size=pj.get_int64(msg, "size"),
            mode=pj.get_uint32(msg, "mode"),
            permissions=pj.get_str(msg, "permissions"),
            owner=pj.get_str(msg, "owner"),
            group=pj.get_str(msg, "group"),
            modified_time=pj.get_str(msg, "modified_time"),
            symlink_target=pj.get_opt_str(msg, "symlink_target"),
            metadata=pj.get_str_map(msg, "metadata"),
        )


@dataclass(frozen=True)
class PathRequest:
    """StatRequest, MakeDirRequest, RemoveRequest."""

    path: str = ""

    def to_json(self) -> dict[str, object]:
        return {"path": self.path} if self.path else {}

    @classmethod
    def from_json(cls, msg: Json) -> PathRequest:
        return cls(pj.get_str(msg, "path"))


@dataclass(frozen=True)
class ListDirRequest:
    path: str = ""
    depth: int = 0

    def to_json(self) -> dict[str, object]:
        return {k: v for k, v in (("path", self.path), ("depth", self.depth)) if v}

    @classmethod
    def from_json(cls, msg: Json) -> ListDirRequest:
        return cls(pj.get_str(msg, "path"), pj.get_uint32(msg, "depth"))


@dataclass(frozen=True)
class MoveRequest:
    source: str = ""
    destination: str = ""

    def to_json(self) -> dict[str, object]:
        return {k: v for k, v in (("source", self.source), ("destination", self.destination)) if v}

    @classmethod
    def from_json(cls, msg: Json) -> MoveRequest:
        return cls(pj.get_str(msg, "source"), pj.get_str(msg, "destination"))


@dataclass(frozen=True)
class WatchRequest:
    """WatchDirRequest and CreateWatcherRequest."""

    path: str = ""
    recursive: bool = False
    include_entry: bool = False
    allow_network_mounts: bool = False

    def to_json(self) -> dict[str, object]:
        fields = (
            ("path", self.path),
            ("recursive", self.recursive),
            ("includeEntry", self.include_entry),
            ("allowNetworkMounts", self.allow_network_mounts),
        )
        return {k: v for k, v in fields if v}

    @classmethod
    def from_json(cls, msg: Json) -> WatchRequest:
        return cls(
            pj.get_str(msg, "path"),
            pj.get_bool(msg, "recursive"),
            pj.get_bool(msg, "include_entry"),
            pj.get_bool(msg, "allow_network_mounts"),
        )


@dataclass(frozen=True)
class WatcherRequest:
    """GetWatcherEventsRequest and RemoveWatcherRequest."""

    watcher_id: str = ""

    def to_json(self) -> dict[str, object]:
        return {"watcherId": self.watcher_id} if self.watcher_id else {}

    @classmethod
    def from_json(cls, msg: Json) -> WatcherRequest:
        return cls(pj.get_str(msg, "watcher_id"))


@dataclass(frozen=True)
class EntryResponse:
    """StatResponse, MakeDirResponse, MoveResponse."""

    entry: EntryInfo

    def to_json(self) -> dict[str, object]:
        return {"entry": self.entry.to_json()}

    @classmethod
    def from_json(cls, msg: Json) -> EntryResponse:
        entry = pj.get_obj(msg, "entry")
        if entry is None:
            raise pj.ProtoJsonError("entry is required")
        return cls(EntryInfo.from_json(entry))


@dataclass(frozen=True)
class ListDirResponse:
    """`entries` is written even when empty."""

    entries: tuple[EntryInfo, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"entries": [e.to_json() for e in self.entries]}

    @classmethod
    def from_json(cls, msg: Json) -> ListDirResponse:
        return cls(tuple(EntryInfo.from_json(e) for e in pj.get_objs(msg, "entries")))


@dataclass(frozen=True)
class FilesystemEvent:
    """`type`: an EventType name (EVENT_TYPE_CREATE, …); `entry` only when the watch asked for entries."""

    name: str
    type: str
    entry: EntryInfo | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"name": self.name, "type": self.type}
        if self.entry is not None:
            out["entry"] = self.entry.to_json()
        return out

    @classmethod
    def from_json(cls, msg: Json) -> FilesystemEvent:
        entry = pj.get_obj(msg, "entry")
        return cls(
            pj.get_str(msg, "name"),
            pj.get_str(msg, "type"),
            None if entry is None else EntryInfo.from_json(entry),
        )


@dataclass(frozen=True)
class WatchDirResponse:
    """One envelope of WatchDir: `start{}`, `filesystem{…}` or `keepalive{}` (a oneof, no wrapper)."""

    kind: Literal["start", "filesystem", "keepalive"]
    filesystem: FilesystemEvent | None = None

    def to_json(self) -> dict[str, object]:
        body = self.filesystem.to_json() if self.kind == "filesystem" and self.filesystem is not None else {}
        return {self.kind: body}

    @classmethod
    def from_json(cls, msg: Json) -> WatchDirResponse:
        event = pj.get_obj(msg, "filesystem")
        if event is not None:
            return cls("filesystem", FilesystemEvent.from_json(event))
        if pj.get_obj(msg, "start") is not None:
            return cls("start")
        if pj.get_obj(msg, "keepalive") is not None:
            return cls("keepalive")
        raise pj.ProtoJsonError("a watch event must be start, filesystem or keepalive")


@dataclass(frozen=True)
class CreateWatcherResponse:
    watcher_id: str

    def to_json(self) -> dict[str, object]:
        return {"watcherId": self.watcher_id}

    @classmethod
    def from_json(cls, msg: Json) -> CreateWatcherResponse:
        return cls(pj.get_str(msg, "watcher_id"))


@dataclass(frozen=True)
class GetWatcherEventsResponse:
    events: tuple[FilesystemEvent, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"events": [e.to_json() for e in self.events]} if self.events else {}

    @classmethod
    def from_json(cls, msg: Json) -> GetWatcherEventsResponse:
        return cls(tuple(FilesystemEvent.from_json(e) for e in pj.get_objs(msg, "events")))


@dataclass(frozen=True)
class UploadedEntry:
    """One entry of `POST /files`'s reply (envd's EntryInfo of the REST API): always a file; `metadata` as read
    back from the file (envd 0.6.2)."""

    path: str
    name: str
    metadata: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"path": self.path, "name": self.name, "type": "file"}
        if self.metadata:
            out["metadata"] = dict(self.metadata)
        return out

    @classmethod
    def from_json(cls, msg: Json) -> UploadedEntry:
        return cls(pj.get_str(msg, "path"), pj.get_str(msg, "name"), pj.get_str_map(msg, "metadata"))
