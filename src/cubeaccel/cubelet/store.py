"""The Cubelet journal: SQLite (WAL, synchronous=FULL). One store per node; everything else is derived.

Every device state change is a compare-and-swap on (state, generation) with its event row written
in the same transaction, so a crash at any point leaves either both or neither.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cubeaccel.cubelet.schema import MIGRATIONS, SCHEMA_VERSION
from cubeaccel.model.checkpoint import ReservationCheckpoint
from cubeaccel.model.device import (
    AcceleratorClass,
    DeviceIdentity,
    DeviceRecord,
    DiscoveredDevice,
    PciAddress,
)
from cubeaccel.model.event_kinds import EventKind
from cubeaccel.model.reservation_params import ReservationParams
from cubeaccel.model.reservation_states import ReservationEvent, ReservationPhase, next_phase
from cubeaccel.model.states import Actor, DeviceEvent, DeviceState, transition
from cubeaccel.protocol.errors import CubeError


class StaleRecord(CubeError):
    """The compare-and-swap lost: someone changed the device first."""


@dataclass(frozen=True)
class Event:
    seq: int
    at: float
    kind: str
    device_id: str | None
    sandbox_id: str | None
    event: str | None
    from_state: str | None
    to_state: str | None
    actor: str
    reason: str | None
    details: dict[str, Any]

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass
class Reservation:
    """A sandbox's reservation of devices; `checkpoint` is what Cubelet recorded about its start and release."""

    sandbox_id: str
    params: ReservationParams
    device_ids: list[str]
    phase: ReservationPhase
    created_at: float
    expires_at: float | None
    checkpoint: ReservationCheckpoint = field(default_factory=ReservationCheckpoint)
    releasing_since: float | None = None

    @property
    def shim_id(self) -> str:
        """The id its shim, VMM and run directory carry: its own, or the warm one a claim renamed it from."""
        return self.checkpoint.shim_id or self.sandbox_id

    def fire(self, event: ReservationEvent) -> None:
        """Change the phase through the table (`reservation.transition_refused` if it does not allow it)."""
        self.phase = next_phase(self.phase, event)


_KEEP = object()


# Decoded immutable columns by their stored text: a device's address, identity and labels are written once at
# registration and read on every transition (a reserve+release cycle decodes ~15 device rows).
_DECODED: dict[tuple[str, str, str], tuple[PciAddress, DeviceIdentity, dict[str, str]]] = {}
_DECODED_MAX = 8192


def _immutable_columns(r: sqlite3.Row) -> tuple[PciAddress, DeviceIdentity, dict[str, str]]:
    key = (r["address"], r["identity"], r["labels"])
    hit = _DECODED.get(key)
    if hit is None:
        if len(_DECODED) >= _DECODED_MAX:
            _DECODED.clear()
        hit = _DECODED[key] = (
            PciAddress.parse(key[0]),
            DeviceIdentity.from_json(json.loads(key[1])),
            json.loads(key[2]),
        )
    return hit


def _row_to_device(r: sqlite3.Row) -> DeviceRecord:
    address, identity, labels = _immutable_columns(r)
    return DeviceRecord(
        id=r["id"],
        address=address,
        identity=identity,
        accel_class=AcceleratorClass(r["accel_class"]),
        backend=r["backend"],
        numa_node=r["numa_node"],
        iommu_group=r["iommu_group"],
        expected_driver=r["expected_driver"],
        labels=dict(labels),  # a copy: callers may build on it
        state=DeviceState(r["state"]),
        generation=r["generation"],
        reason=r["reason"],
        sandbox_id=r["sandbox_id"],
        updated_at=r["updated_at"],
    )


# Decoded params by their stored text: written once (reserve, claim) and read on every reservation read; the
# contract in them is parsed and its digest checked, which costs more than the rest of a row.
_PARAMS: dict[str, ReservationParams] = {}
_PARAMS_MAX = 1024


def _params(text: str) -> ReservationParams:
    hit = _PARAMS.get(text)
    if hit is None:
        if len(_PARAMS) >= _PARAMS_MAX:
            _PARAMS.clear()
        hit = _PARAMS[text] = ReservationParams.from_json(json.loads(text))
    return hit


def _row_to_reservation(r: sqlite3.Row) -> Reservation:
    return Reservation(
        sandbox_id=r["sandbox_id"],
        params=_params(r["params"]),
        device_ids=json.loads(r["device_ids"]),
        phase=ReservationPhase(r["phase"]),
        created_at=r["created_at"],
        expires_at=r["expires_at"],
        checkpoint=ReservationCheckpoint.from_json(json.loads(r["checkpoint"])),
        releasing_since=r["releasing_since"],
    )


def _row_to_event(r: sqlite3.Row) -> Event:
    return Event(
        seq=r["seq"],
        at=r["at"],
        kind=r["kind"],
        device_id=r["device_id"],
        sandbox_id=r["sandbox_id"],
        event=r["event"],
        from_state=r["from_state"],
        to_state=r["to_state"],
        actor=r["actor"],
        reason=r["reason"],
        details=json.loads(r["details"]),
    )


class Tx:
    """Operations inside one BEGIN IMMEDIATE … COMMIT."""

    def __init__(self, conn: sqlite3.Connection, now: float, emitted: list[Event] | None = None) -> None:
        self.c = conn
        self.now = now
        self.emitted = emitted  # events of this change, for the store's listeners once it is in (not on reads)

    # ---- devices --------------------------------------------------------------------------------
    def device(self, device_id: str) -> DeviceRecord | None:
        r = self.c.execute("SELECT * FROM devices WHERE id=?", (device_id,)).fetchone()
        return None if r is None else _row_to_device(r)

    def devices(self, state: DeviceState | None = None) -> list[DeviceRecord]:
        if state is None:
            rows = self.c.execute("SELECT * FROM devices ORDER BY address, id").fetchall()
        else:
            rows = self.c.execute("SELECT * FROM devices WHERE state=? ORDER BY address", (state.value,)).fetchall()
        return [_row_to_device(r) for r in rows]

    def devices_of(self, sandbox_id: str) -> list[DeviceRecord]:
        rows = self.c.execute("SELECT * FROM devices WHERE sandbox_id=? ORDER BY address", (sandbox_id,)).fetchall()
        return [_row_to_device(r) for r in rows]

    def insert_device(self, d: DiscoveredDevice, expected_driver: str | None, actor: Actor) -> DeviceRecord:
        self.c.execute(
            "INSERT INTO devices (id,address,backend,accel_class,identity,numa_node,iommu_group,expected_driver,"
            "labels,state,generation,reason,sandbox_id,updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                d.device_id,
                str(d.address),
                d.backend,
                d.accel_class.value,
                json.dumps(d.identity.to_json()),
                d.numa_node,
                d.iommu_group,
                expected_driver,
                json.dumps(d.labels, sort_keys=True),
                DeviceState.INITIALIZED.value,
                1,
                None,
                None,
                self.now,
            ),
        )
        self.event(
            EventKind.DISCOVERED,
            actor,
            device_id=d.device_id,
            to_state=DeviceState.INITIALIZED.value,
            details={"address": str(d.address), "identity": d.identity.to_json(), "labels": d.labels},
        )
        rec = self.device(d.device_id)
        assert rec is not None
        return rec

    def transition(
        self,
        device: DeviceRecord,
        event: DeviceEvent,
        actor: Actor,
        *,
        reason: str | None = None,
        sandbox_id: Any = _KEEP,
        details: dict[str, Any] | None = None,
    ) -> DeviceRecord:
        """CAS on (state, generation); the event row lands in the same transaction."""
        target = transition(device.state, event, actor)
        new_sandbox = device.sandbox_id if sandbox_id is _KEEP else sandbox_id
        cur = self.c.execute(
            "UPDATE devices SET state=?, generation=generation+1, reason=?, sandbox_id=?, updated_at=? "
            "WHERE id=? AND state=? AND generation=?",
            (target.value, reason, new_sandbox, self.now, device.id, device.state.value, device.generation),
        )
        if cur.rowcount != 1:
            raise StaleRecord(
                code="store.stale_record",
                message=f"device {device.id} changed concurrently (expected {device.state.value}@{device.generation})",
                layer="cubelet",
                status=409,
            )
        self.event(
            EventKind.TRANSITION,
            actor,
            device_id=device.id,
            sandbox_id=new_sandbox or device.sandbox_id,
            event=event.value,
            from_state=device.state.value,
            to_state=target.value,
            reason=reason,
            details=details or {},
        )
        # The CAS matched (state, generation), so the other columns are the ones `device` holds (nothing else
        # writes them without a new generation): the row is built here, not read back.
        return dataclasses.replace(
            device,
            state=target,
            generation=device.generation + 1,
            reason=reason,
            sandbox_id=new_sandbox,
            updated_at=self.now,
            labels=dict(device.labels),
        )

    def set_reason(self, device: DeviceRecord, reason: str | None) -> bool:
        """Why a device stays where it is (an `initialized` device on a host that is not ready), without a
        transition: same state, same generation. False when the device changed meanwhile."""
        cur = self.c.execute(
            "UPDATE devices SET reason=?, updated_at=? WHERE id=? AND state=? AND generation=?",
            (reason, self.now, device.id, device.state.value, device.generation),
        )
        return cur.rowcount == 1

    # ---- reservations ---------------------------------------------------------------------------
    def reservation(self, sandbox_id: str) -> Reservation | None:
        r = self.c.execute("SELECT * FROM reservations WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        return None if r is None else _row_to_reservation(r)

    def reservation_of_shim(self, shim_id: str) -> Reservation | None:
        """The reservation a claim renamed from `shim_id` (its shim still runs, and reports, under that id)."""
        rows = self.c.execute(
            "SELECT * FROM reservations WHERE json_extract(checkpoint, '$.shim_id') = ?", (shim_id,)
        ).fetchall()
        return _row_to_reservation(rows[0]) if rows else None

    def timeline(self, sandbox_id: str, limit: int = 10000) -> list[dict[str, Any]]:
        """The sandbox's events in order, only the columns a reply's timeline shows (no details decoded)."""
        rows = self.c.execute(
            "SELECT at,kind,event,device_id,to_state FROM events WHERE sandbox_id=? ORDER BY seq LIMIT ?",
            (sandbox_id, limit),
        ).fetchall()
        return [dict(r) for r in rows]

    def last_closed(self, sandbox_id: str) -> dict[str, Any] | None:
        """The details of the sandbox's newest `reservation_closed` event, if it has one."""
        r = self.c.execute(
            "SELECT details FROM events WHERE sandbox_id=? AND kind='reservation_closed' ORDER BY seq DESC LIMIT 1",
            (sandbox_id,),
        ).fetchone()
        return None if r is None else dict(json.loads(r["details"]))

    def reservations(self) -> list[Reservation]:
        rows = self.c.execute("SELECT * FROM reservations ORDER BY created_at").fetchall()
        return [_row_to_reservation(r) for r in rows]

    def insert_reservation(self, res: Reservation) -> None:
        self.c.execute(
            "INSERT INTO reservations (sandbox_id,params,device_ids,phase,created_at,expires_at,checkpoint,"
            "releasing_since)"
            " VALUES (?,?,?,?,?,?,?,?)",
            (
                res.sandbox_id,
                json.dumps(res.params.to_json(), sort_keys=True),
                json.dumps(res.device_ids),
                res.phase.value,
                res.created_at,
                res.expires_at,
                json.dumps(res.checkpoint.to_json()),
                res.releasing_since,
            ),
        )

    def update_reservation(self, res: Reservation) -> None:
        self.c.execute(
            "UPDATE reservations SET phase=?, expires_at=?, checkpoint=?, releasing_since=? WHERE sandbox_id=?",
            (
                res.phase.value,
                res.expires_at,
                json.dumps(res.checkpoint.to_json()),
                res.releasing_since,
                res.sandbox_id,
            ),
        )

    def update_reservation_params(self, res: Reservation) -> None:
        """A running sandbox's recorded parameters changed in place (its egress policy:
        cubelet/network_update.py), with its checkpoint, in the caller's transaction."""
        self.c.execute(
            "UPDATE reservations SET params=?, checkpoint=? WHERE sandbox_id=?",
            (json.dumps(res.params.to_json(), sort_keys=True), json.dumps(res.checkpoint.to_json()), res.sandbox_id),
        )

    def claim_reservation(self, warm_id: str, res: Reservation) -> bool:
        """A warm reservation becomes `res` (its new sandbox id, params and checkpoint), and its devices follow:
        one compare-and-swap on the warm row's phase, so two claims never take the same one."""
        cur = self.c.execute(
            "UPDATE reservations SET sandbox_id=?, params=?, phase=?, expires_at=?, checkpoint=?"
            " WHERE sandbox_id=? AND phase='warm'",
            (
                res.sandbox_id,
                json.dumps(res.params.to_json(), sort_keys=True),
                res.phase.value,
                res.expires_at,
                json.dumps(res.checkpoint.to_json()),
                warm_id,
            ),
        )
        if cur.rowcount != 1:
            return False
        self.c.execute(
            "UPDATE devices SET sandbox_id=?, generation=generation+1, updated_at=? WHERE sandbox_id=?",
            (res.sandbox_id, self.now, warm_id),
        )
        return True

    def delete_reservation(self, sandbox_id: str) -> None:
        self.c.execute("DELETE FROM reservations WHERE sandbox_id=?", (sandbox_id,))

    # ---- events and meta ------------------------------------------------------------------------
    def event(
        self,
        kind: EventKind,
        actor: Actor | str,
        *,
        device_id: str | None = None,
        sandbox_id: str | None = None,
        event: str | None = None,
        from_state: str | None = None,
        to_state: str | None = None,
        reason: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        self.c.execute(
            "INSERT INTO events (at,kind,device_id,sandbox_id,event,from_state,to_state,actor,reason,details)"
            " VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                self.now,
                kind,
                device_id,
                sandbox_id,
                event,
                from_state,
                to_state,
                str(actor),
                reason,
                json.dumps(details or {}, sort_keys=True, default=str),
            ),
        )
        if self.emitted is not None:
            self.emitted.append(
                Event(
                    0,
                    self.now,
                    kind,
                    device_id,
                    sandbox_id,
                    event,
                    from_state,
                    to_state,
                    str(actor),
                    reason,
                    details or {},
                )
            )

    def set_original_driver(self, device_id: str, driver: str | None) -> None:
        """The host driver before we bound vfio-pci: what `disable --restore-driver` gives back."""
        self.c.execute("UPDATE devices SET original_driver=? WHERE id=?", (driver, device_id))

    def aer_baselines(self) -> dict[str, int]:
        rows = self.c.execute("SELECT id, aer_baseline FROM devices WHERE aer_baseline IS NOT NULL").fetchall()
        return {r["id"]: int(r["aer_baseline"]) for r in rows}

    def set_aer_baseline(self, device_id: str, count: int) -> None:
        self.c.execute("UPDATE devices SET aer_baseline=? WHERE id=?", (count, device_id))

    def original_driver(self, device_id: str) -> str | None:
        r = self.c.execute("SELECT original_driver FROM devices WHERE id=?", (device_id,)).fetchone()
        return None if r is None else r["original_driver"]

    def meta(self, key: str) -> str | None:
        r = self.c.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if r is None else str(r["value"])

    def set_meta(self, key: str, value: str) -> None:
        self.c.execute("INSERT OR REPLACE INTO meta (key,value) VALUES (?,?)", (key, value))


class Store:
    """Thread-safe facade over one writer connection, and a read connection per thread.

    A transaction's body runs on the writer connection under its lock and commits durably (`synchronous=FULL`)
    before `tx()` returns, so a reply sent after it never announces a change a crash could lose. One commit per
    change: a node's decisions are bounded by VM starts, not by commits (docs/decisions.md, "One commit per
    change"). Reads use their thread's own connection in WAL mode: they see only committed state and never
    wait for the writer.
    """

    def __init__(self, path: Path, *, clock: Any = time.time) -> None:
        self.path = path
        self.clock = clock
        self._lock = threading.RLock()
        self._conn = self._connect()
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._migrate()
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._closed = False
        self.commits = 0  # durable commits so far (the benchmark's commits per cycle)
        # Called with each change's events once its transaction is in (metrics, logs); never inside the lock.
        self.listeners: list[Callable[[list[Event]], None]] = []

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=30)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    def _migrate(self) -> None:
        with self._lock:
            version = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise CubeError(
                    code="store.schema_too_new",
                    message=f"store schema {version} is newer than this cubeaccel ({SCHEMA_VERSION})",
                    layer="cubelet",
                    status=500,
                )
            for v in range(version + 1, SCHEMA_VERSION + 1):
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    step = MIGRATIONS[v]
                    if callable(step):
                        step(self._conn)
                    else:
                        for stmt in step.split(";"):
                            if stmt.strip():
                                self._conn.execute(stmt)
                    self._conn.execute(f"PRAGMA user_version={v}")
                    self._conn.execute("COMMIT")
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise

    @property
    def schema_version(self) -> int:
        with self.read() as t:
            return int(t.c.execute("PRAGMA user_version").fetchone()[0])

    @contextmanager
    def tx(self) -> Iterator[Tx]:
        """One atomic change, durable when the block exits. A transaction opened inside another on the same
        thread is a savepoint of it: it rolls back alone, and commits with the outer one."""
        depth = int(getattr(self._local, "depth", 0))
        with self._lock:
            if self._closed:
                raise CubeError("store.closed", "the store is closed", "cubelet")
            name = f"tx{depth}"
            self._conn.execute("BEGIN IMMEDIATE" if depth == 0 else f"SAVEPOINT {name}")
            self._local.depth = depth + 1
            if depth == 0:
                self._local.emitted = []
            emitted: list[Event] = self._local.emitted
            mark = len(emitted)
            try:
                yield Tx(self._conn, float(self.clock()), emitted)
            except BaseException:
                del emitted[mark:]
                if depth == 0:
                    self._conn.execute("ROLLBACK")
                else:
                    self._conn.execute(f"ROLLBACK TO {name}")
                    self._conn.execute(f"RELEASE {name}")
                raise
            finally:
                self._local.depth = depth
            if depth:
                self._conn.execute(f"RELEASE {name}")
                return
            try:
                self._conn.execute("COMMIT")
            except sqlite3.Error as e:  # disk full, I/O error: the change is not made
                with suppress(sqlite3.Error):
                    self._conn.execute("ROLLBACK")
                raise CubeError("store.commit_failed", f"the store could not commit: {e}", "cubelet") from e
            self.commits += 1
        self._local.emitted = []
        for listener in self.listeners if emitted else ():
            with suppress(Exception):  # telemetry never fails a change that is already made
                listener(emitted)

    @contextmanager
    def read(self) -> Iterator[Tx]:
        """A consistent snapshot of committed state, on this thread's own connection; inside a transaction
        of this thread, the transaction itself (it must see its own changes)."""
        if getattr(self._local, "depth", 0):
            with self._lock:
                yield Tx(self._conn, float(self.clock()))
            return
        conn: sqlite3.Connection | None = getattr(self._local, "reader", None)
        if conn is None:
            conn = self._connect()
            self._local.reader = conn
            with self._readers_lock:
                self._readers.append(conn)
        conn.execute("BEGIN")
        try:
            yield Tx(conn, float(self.clock()))
        finally:
            conn.execute("COMMIT")

    def devices(self) -> list[DeviceRecord]:
        with self.read() as t:
            return t.devices()

    def device(self, device_id: str) -> DeviceRecord | None:
        with self.read() as t:
            return t.device(device_id)

    def reservation(self, sandbox_id: str) -> Reservation | None:
        with self.read() as t:
            return t.reservation(sandbox_id)

    def reservations(self) -> list[Reservation]:
        with self.read() as t:
            return t.reservations()

    def events(
        self, since: int = 0, limit: int = 1000, device_id: str | None = None, sandbox_id: str | None = None
    ) -> list[Event]:
        q = "SELECT * FROM events WHERE seq>?"
        args: list[Any] = [since]
        if device_id is not None:
            q += " AND device_id=?"
            args.append(device_id)
        if sandbox_id is not None:
            q += " AND sandbox_id=?"
            args.append(sandbox_id)
        q += " ORDER BY seq LIMIT ?"
        args.append(limit)
        with self.read() as t:
            rows = t.c.execute(q, args).fetchall()
        return [_row_to_event(r) for r in rows]

    def latest_events(self, limit: int) -> list[Event]:
        """The newest `limit` events, newest first (the dashboard's feed)."""
        with self.read() as t:
            rows = t.c.execute("SELECT * FROM events ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()
        return [_row_to_event(r) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._conn.close()
        with self._readers_lock:
            for conn in self._readers:
                conn.close()
            self._readers.clear()
