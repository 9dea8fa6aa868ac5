"""CubeMaster's store: nodes, templates, sandboxes. SQLite by default, PostgreSQL with `postgresql://`.

Why each write looks the way it does is in `schema.py`'s docstring (no double placement across
replicas). SQLite connections begin with `BEGIN IMMEDIATE` so a read-then-write transaction never
fails half-way with "database is locked"; PostgreSQL uses row locks (`FOR UPDATE`) on the node row.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import sqlalchemy as sa

from cubeaccel.host.service.private import private_file
from cubeaccel.master import schema as S
from cubeaccel.master.records import (
    IdempotencyRecord,
    Quota,
    Refusal,
    SandboxChange,
    SandboxRow,
    TemplateRecord,
    WarmClaim,
)
from cubeaccel.master.view import NodeView, view_from_heartbeat
from cubeaccel.model.sandbox_states import (
    HELD_STATES,
    NODE_MACHINE,
    PLACEMENT_STATES,
    SANDBOX_MACHINE,
    NodeEvent,
    NodeState,
    SandboxActor,
    SandboxEvent,
    SandboxState,
)
from cubeaccel.model.states import Actor
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire import master_api as W
from cubeaccel.wire.base import Record

SS = SandboxState
InsertOutcome = Literal["inserted", "sandbox", "refused", "retry"]


def _row(r: sa.Row[Any]) -> SandboxRow:
    return SandboxRow.from_columns(dict(r._mapping))


def engine_for(url: str) -> sa.Engine:
    """`sqlite:///path`, a plain path, or `postgresql://…` (driven by psycopg 3)."""
    if url.startswith(("postgresql://", "postgres://")):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
        return sa.create_engine(url, pool_size=20, max_overflow=20, pool_pre_ping=True)
    if not url.startswith("sqlite"):
        Path(url).parent.mkdir(parents=True, exist_ok=True)
        private_file(
            Path(url)
        )  # key digests, the node secret; SQLite gives its -wal/-shm files the database file's mode
        url = f"sqlite:///{url}"
    engine = sa.create_engine(
        url, connect_args={"check_same_thread": False, "timeout": 30}, pool_size=10, max_overflow=20
    )

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        dbapi_conn.execute("PRAGMA journal_mode=WAL")
        dbapi_conn.execute("PRAGMA busy_timeout=30000")

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


class MasterStore:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = engine_for(url)
        self.dialect = self.engine.dialect.name
        self.listeners: list[Callable[[SandboxChange], None]] = []  # each sandbox state change, once it is in
        with self.engine.begin() as conn:
            self.schema_version = S.migrate(conn)

    @contextmanager
    def tx(self) -> Iterator[sa.Connection]:
        with self.engine.begin() as conn:
            yield conn

    def close(self) -> None:
        self.engine.dispose()

    # ---- nodes ------------------------------------------------------------------------------------
    def heartbeat(self, body: Mapping[str, Any], now: float, staleness_s: float) -> tuple[str, bool]:
        """Record a heartbeat; returns (operator state, whether the node is new or was stale)."""
        beat = self.record_heartbeat(body, now, staleness_s)
        return beat.state, beat.returned

    def record_heartbeat(self, body: Mapping[str, Any], now: float, staleness_s: float) -> HeartbeatRecorded:
        """Record a heartbeat; returns what a replica's cache needs to take it in without reading the row again.

        A live node's URL is not changed by a heartbeat naming another one (409 `node.url_conflict`):
        otherwise any caller could redirect a node's reservations. A stale node may come back elsewhere.
        A beat whose summary (all but `sent_at`) matches the stored one's digest writes only the two clocks: most
        beats repeat the last summary, and rewriting the whole JSON row for each was most of a beat's cost.
        """
        view = view_from_heartbeat(body, now)  # validates the shape before anything is written
        name = view.name
        stored = {**body, "cubelet_url": view.cubelet_url}
        digest = summary_digest(stored)
        with self.tx() as c:
            n = S.nodes
            row = c.execute(
                sa.select(n.c.state, n.c.received_at, n.c.cubelet_url, n.c.summary_digest)
                .where(n.c.name == name)
                .with_for_update()
            ).first()
            clocks = {"received_at": now, "sent_at": view.sent_at}
            values = {**clocks, "cubelet_url": view.cubelet_url, "heartbeat": stored, "summary_digest": digest}
            if row is None:
                c.execute(n.insert().values(name=name, state=NodeState.READY.value, registered_at=now, **values))
                return HeartbeatRecorded(name, NodeState.READY.value, True, digest, now, view.sent_at)
            stale = now - float(row.received_at) > staleness_s
            if row.cubelet_url != view.cubelet_url and not stale:
                raise CubeError(
                    "node.url_conflict",
                    f"node {name} is live at {row.cubelet_url}; a heartbeat "
                    f"naming {view.cubelet_url} is refused until it has been stale for "
                    f"{staleness_s:g}s",
                    "api",
                    {"cubelet_url": row.cubelet_url},
                )
            c.execute(n.update().where(n.c.name == name).values(**(clocks if row.summary_digest == digest else values)))
            return HeartbeatRecorded(name, str(row.state), stale, digest, now, view.sent_at)

    def node_event(self, name: str, event: NodeEvent, actor: Actor = Actor.OPERATOR) -> NodeState:
        """An operator's drain/undrain, through the node table; returns the node's state afterwards."""
        with self.tx() as c:
            r = c.execute(sa.select(S.nodes.c.state).where(S.nodes.c.name == name).with_for_update()).first()
            if r is None:
                raise CubeError("node.not_found", f"no node {name!r}", "api")
            target = NODE_MACHINE.transition(NodeState(r.state), event, actor)
            c.execute(S.nodes.update().where(S.nodes.c.name == name).values(state=target.value))
            return target

    def mark_reconciled(self, name: str, now: float) -> None:
        with self.tx() as c:
            c.execute(S.nodes.update().where(S.nodes.c.name == name).values(reconciled_at=now))

    def node_views(
        self, known: Mapping[str, tuple[str | None, str]] | None = None
    ) -> tuple[list[NodeView], list[NodeLiveness]]:
        """Nodes whose (summary digest, state) differ from `known`, freshly parsed, and every node's liveness.

        A replica re-reads and re-parses only the summaries that changed since its last look; a beat that
        repeated its summary reaches the replica as new clocks on the view it holds. Claims are attached by the
        caller from `admitted_as_of()`, which is one aggregate query.
        """
        known = known or {}
        n = S.nodes
        with self.tx() as c:
            q = sa.select(n.c.name, n.c.summary_digest, n.c.state, n.c.received_at, n.c.sent_at)
            index = [NodeLiveness(*r) for r in c.execute(q)]
            changed = [x.name for x in index if x.digest is None or known.get(x.name) != (x.digest, x.state)]
            rows = c.execute(sa.select(n).where(n.c.name.in_(changed))).all() if changed else []
        return [_view(r) for r in rows], index

    def node_view(self, name: str) -> NodeView | None:
        """One node's view with its claims and warm claims, in one transaction: what a replica's cache needs to
        take in a node that appeared or came back, without reading every node."""
        n, w = S.nodes, S.warm_claims
        with self.tx() as c:
            r = c.execute(sa.select(n).where(n.c.name == name)).first()
            if r is None:
                return None
            view = _view(r)
            view.admitted = _admitted(c, name).get(name, {})
            view.admitted_memory_mib = _admitted_memory(c, name).get(name, 0)
            view.warm_claimed = frozenset(str(x) for (x,) in c.execute(sa.select(w.c.warm_id).where(w.c.node == name)))
        return view

    def node_url(self, name: str) -> str | None:
        """One node's registered Cubelet URL, as stored now (one row, not every node's)."""
        with self.tx() as c:
            url = c.execute(sa.select(S.nodes.c.cubelet_url).where(S.nodes.c.name == name)).scalar()
        return None if url is None else str(url)

    def admitted(self) -> dict[str, dict[str, int]]:
        with self.tx() as c:
            return _admitted(c, None)

    def admitted_as_of(self) -> dict[str, NodeAdmitted]:
        """Per node, what `admitted()` and `admitted_memory()` give, with the summary's `sent_at` they were derived
        against: one statement, so each node's claims and that `sent_at` describe the same heartbeat."""
        s, n = S.sandboxes, S.nodes
        q = (
            sa.select(n.c.name, n.c.sent_at, s.c.group_key, sa.func.sum(s.c.count), sa.func.sum(s.c.pinned_mib))
            .select_from(n.outerjoin(s, sa.and_(s.c.node == n.c.name, _unseen())))
            .group_by(n.c.name, n.c.sent_at, s.c.group_key)
        )
        out: dict[str, NodeAdmitted] = {}
        with self.tx() as c:
            for name, sent_at, key, count, pinned in c.execute(q):
                entry = out.setdefault(name, NodeAdmitted(sent_at))
                if key is not None and count:
                    entry.devices[key] = int(count)
                entry.memory_mib += int(pinned or 0)
        return out

    def placements(self, nodes: Collection[str]) -> list[Placement]:
        """The live placements on `nodes`, for a caller that must compare them with summaries older than the
        stored ones (`Placement.unseen_by`)."""
        s = S.sandboxes
        q = sa.select(s.c.node, s.c.group_key, s.c.count, s.c.pinned_mib, s.c.state, s.c.cubelet_created_at).where(
            s.c.node.in_(list(nodes)),
            s.c.state.in_([SS.PLACING.value, *(h.value for h in HELD_STATES)]),
            s.c.warm_id.is_(None),  # as in `_unseen`: a warm claim's devices were held before it
        )
        with self.tx() as c:
            return [
                Placement(node, key, int(count), int(pinned or 0), None if state == SS.PLACING.value else created)
                for node, key, count, pinned, state, created in c.execute(q)
            ]

    def admitted_memory(self) -> dict[str, int]:
        """Per node, MiB of lockable memory placed that its last heartbeat cannot show yet."""
        with self.tx() as c:
            return _admitted_memory(c, None)

    def deleting_devices(self) -> dict[str, dict[str, int]]:
        """node → group key → devices of sandboxes being deleted, or deleted after the node's last heartbeat
        reached us: on their way back, before a summary shows them releasing."""
        s, n = S.sandboxes, S.nodes
        unreported = sa.and_(s.c.state == SS.DELETED.value, s.c.updated_at > n.c.received_at)
        q = (
            sa.select(s.c.node, s.c.group_key, sa.func.sum(s.c.count))
            .select_from(s.join(n, s.c.node == n.c.name))
            .where(sa.or_(s.c.state == SS.DELETING.value, unreported))
            .group_by(s.c.node, s.c.group_key)
        )
        out: dict[str, dict[str, int]] = {}
        with self.tx() as c:
            for node, key, total in c.execute(q):
                out.setdefault(node, {})[key] = int(total)
        return out

    def all_node_views(self) -> list[NodeView]:
        views, _ = self.node_views()
        admitted, memory = self.admitted(), self.admitted_memory()
        for v in views:
            v.admitted = admitted.get(v.name, {})
            v.admitted_memory_mib = memory.get(v.name, 0)
        return views

    def admit(
        self,
        sandbox_id: str,
        node: str,
        group_key: str,
        count: int,
        now: float,
        staleness_s: float,
        pinned_mib: int = 0,
        *,
        tenant: str | None = None,
        accel_class: str | None = None,
        returning: int = 0,
    ) -> bool:
        """Admit a placement on `node` under its row lock, or say no (the caller tries the next node).
        Devices and pinned memory are both re-checked against the summary minus the claims it cannot show;
        `returning`: devices of the group coming back that this placement may count on (a create whose reserve
        waits for them on the node, master/capacity_wait.py).
        The tenant's quota is checked in the same transaction under the tenant's row lock (taken after the
        node's, always in that order), so concurrent creates through any replica cannot overshoot it: a
        refusal raises `quota.*`."""
        with self.tx() as c:
            r = c.execute(sa.select(S.nodes).where(S.nodes.c.name == node).with_for_update()).first()
            if r is None or r.state != NodeState.READY or now - r.received_at > staleness_s:
                return False
            view = _view(r)
            group = next((g for g in view.groups if g.key == group_key), None)
            admitted = _admitted(c, node).get(node, {}).get(group_key, 0)
            if count > 0 and (group is None or group.allocatable + returning - admitted < count):
                return False  # a CPU-only placement (count 0) takes no device: only memory and quota decide
            if pinned_mib and view.pinnable_memory_mib - _admitted_memory(c, node).get(node, 0) < pinned_mib:
                return False
            values = {"node": node, "group_key": group_key, "count": count, "pinned_mib": pinned_mib}
            return _placement_row(c, sandbox_id, tenant, now, accel_class=accel_class, **values)

    def claim_warm(
        self,
        sandbox_id: str,
        node: str,
        warm_ids: Collection[str],
        pool: str,
        group_key: str,
        count: int,
        now: float,
        staleness_s: float,
        pinned_mib: int = 0,
        *,
        tenant: str | None = None,
        accel_class: str | None = None,
    ) -> str | None:
        """Take one of `warm_ids` on `node` for this create, under the node's row lock: the first that the node's
        latest heartbeat still advertises and no claim row holds gets a claim row (primary key: node and warm
        id, so no two creates on any replica hold one warm sandbox), and the sandbox row becomes `placing`
        there with it, after the tenant's quota (`quota.*` raised). None: the node is no longer ready or fresh,
        or every one is taken. The warm sandbox's devices and memory are already held on the node, so this
        row takes nothing from the summary (`_unseen`); it counts against the tenant like any placement."""
        with self.tx() as c:
            r = c.execute(sa.select(S.nodes).where(S.nodes.c.name == node).with_for_update()).first()
            if r is None or r.state != NodeState.READY or now - r.received_at > staleness_s:
                return None
            view = _view(r)
            advertised = {w.id for p in view.warm_pools if p.key == pool for w in p.sandboxes}
            wc = S.warm_claims
            held = {
                row.warm_id
                for row in c.execute(sa.select(wc.c.warm_id).where(wc.c.node == node, wc.c.warm_id.in_(list(warm_ids))))
            }
            free = [w for w in warm_ids if w in advertised and w not in held]
            if not free:
                return None
            values = {"node": node, "group_key": group_key, "count": count, "pinned_mib": pinned_mib}
            if not _placement_row(c, sandbox_id, tenant, now, accel_class=accel_class, warm_id=free[0], **values):
                return None
            c.execute(wc.insert().values(node=node, warm_id=free[0], sandbox_id=sandbox_id, pool=pool, claimed_at=now))
            return free[0]

    def warm_claims(self) -> list[WarmClaim]:
        with self.tx() as c:
            return [WarmClaim(**r._mapping) for r in c.execute(sa.select(S.warm_claims))]

    def warm_claimed(self) -> dict[str, frozenset[str]]:
        """node → warm ids a claim row holds (not offered to another create)."""
        out: dict[str, set[str]] = {}
        for r in self.warm_claims():
            out.setdefault(r.node, set()).add(r.warm_id)
        return {k: frozenset(v) for k, v in out.items()}

    def settle_warm_claims(self, advertised: Mapping[str, Collection[str]]) -> list[WarmClaim]:
        """Free the claim rows that hold nothing any more; returns them. A row stays while its create is placing
        with it, and while its sandbox is live with it and the node still advertises the id (a heartbeat from
        before the claim): a warm id is never advertised again once claimed on the node. Every other row — the
        create fell back to cold, was refused, or died before the Cubelet took the claim (then the id is still
        advertised and becomes claimable again; had the claim landed, the Cubelet's CAS refuses a second) — is
        deleted."""
        wc, s = S.warm_claims, S.sandboxes
        live = (SS.STARTING.value, SS.RUNNING.value, SS.DELETING.value)
        freed: list[WarmClaim] = []
        with self.tx() as c:
            q = sa.select(wc, s.c.state, s.c.warm_id.label("taken")).select_from(
                wc.outerjoin(s, s.c.id == wc.c.sandbox_id)
            )
            for r in c.execute(q).all():
                mine = r.taken == r.warm_id
                keep = mine and (
                    r.state == SS.PLACING.value or (r.state in live and r.warm_id in advertised.get(r.node, ()))
                )
                if not keep:
                    c.execute(wc.delete().where(wc.c.node == r.node, wc.c.warm_id == r.warm_id))
                    freed.append(WarmClaim(r.node, r.warm_id, r.sandbox_id, r.pool, r.claimed_at))
        return freed

    # ---- templates --------------------------------------------------------------------------------
    def put_template(
        self, name: str, version: str, accel_class: str, digest: str, document: dict[str, Any], now: float
    ) -> bool:
        """Register a version; the same version again must be the same document (else 409)."""
        with self.tx() as c:
            old = c.execute(
                sa.select(S.templates.c.digest).where(S.templates.c.name == name, S.templates.c.version == version)
            ).first()
            if old is not None:
                if old.digest != digest:
                    raise CubeError(
                        "template.version_exists",
                        f"template {name} version {version} exists with another document; register a new version",
                        "template",
                        {"digest": old.digest},
                    )
                return False
            seq = c.execute(sa.select(sa.func.coalesce(sa.func.max(S.templates.c.seq), 0))).scalar_one() + 1
            c.execute(
                S.templates.insert().values(
                    name=name,
                    version=version,
                    seq=seq,
                    accel_class=accel_class,
                    digest=digest,
                    document=document,
                    created_at=now,
                )
            )
            return True

    def template(self, name: str, version: str | None = None) -> TemplateRecord | None:
        q = sa.select(S.templates).where(S.templates.c.name == name)
        q = q.where(S.templates.c.version == version) if version else q.order_by(S.templates.c.seq.desc())
        with self.tx() as c:
            r = c.execute(q.limit(1)).first()
        return None if r is None else TemplateRecord(**r._mapping)

    def templates(self) -> list[TemplateRecord]:
        with self.tx() as c:
            return [TemplateRecord(**r._mapping) for r in c.execute(sa.select(S.templates).order_by(S.templates.c.seq))]

    def delete_template(self, name: str, version: str | None = None) -> int:
        with self.tx() as c:
            q = S.templates.delete().where(S.templates.c.name == name)
            if version:
                q = q.where(S.templates.c.version == version)
            n = c.execute(q).rowcount
            if not c.execute(sa.select(S.templates.c.name).where(S.templates.c.name == name)).first():
                c.execute(S.defaults.delete().where(S.defaults.c.template_name == name))
            return int(n)

    def set_default(self, accel_class: str, name: str) -> None:
        with self.tx() as c:
            c.execute(S.defaults.delete().where(S.defaults.c.accel_class == accel_class))
            c.execute(S.defaults.insert().values(accel_class=accel_class, template_name=name))

    def defaults(self) -> dict[str, str]:
        with self.tx() as c:
            return {r.accel_class: r.template_name for r in c.execute(sa.select(S.defaults))}

    # ---- sandboxes --------------------------------------------------------------------------------
    def insert_sandbox(self, row: SandboxRow) -> SandboxRow | None:
        """Insert; on a duplicate id or (tenant, idempotency key) return the existing record instead."""
        _, existing = self.insert_or_existing(row)
        return existing if isinstance(existing, SandboxRow) else None

    def insert_or_existing(self, row: SandboxRow) -> tuple[InsertOutcome, SandboxRow | IdempotencyRecord | None]:
        """Insert the record and, with a key, its idempotency record, in one transaction. Returns
        ("inserted", None); ("sandbox", existing) on a duplicate id or key whose record exists;
        ("refused", record) when the keyed create was refused (its record holds the refusal); or ("retry", None)
        when the row that conflicted is gone (a refusal deleted it between our insert and our look)."""
        key = row.idempotency_key
        try:
            with self.tx() as c:
                if key:
                    c.execute(
                        S.idempotency.insert().values(
                            tenant=row.tenant,
                            idempotency_key=key,
                            sandbox_id=row.id,
                            request=row.request_json(),
                            refusal=None,
                            created_at=row.created_at,
                        )
                    )
                c.execute(S.sandboxes.insert().values(**row.columns()))
            return "inserted", None
        except sa.exc.IntegrityError:
            pass
        if key:
            record = self.idempotency_record(row.tenant, key)
            if record is not None:
                if record.refusal is not None:
                    return "refused", record
                existing = self.sandbox(record.sandbox_id)
                if existing is not None:
                    return "sandbox", existing
        existing = self.sandbox(row.id)
        return ("sandbox", existing) if existing is not None else ("retry", None)

    def idempotency_record(self, tenant: str, key: str) -> IdempotencyRecord | None:
        with self.tx() as c:
            r = c.execute(
                sa.select(S.idempotency).where(S.idempotency.c.tenant == tenant, S.idempotency.c.idempotency_key == key)
            ).first()
        return None if r is None else IdempotencyRecord.from_columns(dict(r._mapping))

    def refuse_create(self, sandbox_id: str, refusal: Refusal | None) -> None:
        """A create that failed before its sandbox existed anywhere: delete its row (while a create still owns
        it) and, in the same transaction, record the refusal on its idempotency record — or, with no refusal to
        replay (the create died of something else), drop the record so a retry places afresh."""
        with self.tx() as c:
            gone = c.execute(
                S.sandboxes.delete().where(
                    S.sandboxes.c.id == sandbox_id,
                    S.sandboxes.c.state.in_([s.value for s in PLACEMENT_STATES]),
                )
            ).rowcount
            if not gone:
                return
            keyed = S.idempotency.c.sandbox_id == sandbox_id
            if refusal is None:
                c.execute(S.idempotency.delete().where(keyed))
            else:
                c.execute(S.idempotency.update().where(keyed).values(refusal=refusal.to_json()))

    def sandbox(self, sandbox_id: str) -> SandboxRow | None:
        with self.tx() as c:
            r = c.execute(sa.select(S.sandboxes).where(S.sandboxes.c.id == sandbox_id)).first()
        return None if r is None else _row(r)

    def sandboxes(
        self,
        states: tuple[SandboxState, ...] | None = None,
        node: str | None = None,
        limit: int = 1000,
        tenants: Collection[str] | None = None,
    ) -> list[SandboxRow]:
        q = sa.select(S.sandboxes).order_by(S.sandboxes.c.created_at).limit(limit)
        if tenants is not None:
            q = q.where(S.sandboxes.c.tenant.in_(list(tenants)))
        if states:
            q = q.where(S.sandboxes.c.state.in_([s.value for s in states]))
        if node:
            q = q.where(S.sandboxes.c.node == node)
        with self.tx() as c:
            return [_row(r) for r in c.execute(q)]

    def update_sandbox(
        self,
        sandbox_id: str,
        phase: str | None = None,
        expect: tuple[SandboxState, ...] | None = None,
        detail: Record | None = None,
        *,
        event: SandboxEvent | None = None,
        by: SandboxActor | None = None,
        error: W.SandboxError | None = None,
        **values: Any,
    ) -> bool:
        """Set columns (and append a timeline entry `phase` with its `detail`; record `error`) if the sandbox is in
        one of `expect` states.

        A state change is an `event` fired `by` an actor, never a `state=` value: the table decides the target,
        and its guard is the states that actor may fire the event from, narrowed by `expect`. An `expect` naming
        a state the table does not allow is refused (`sandbox.transition_refused`) whatever the row's state,
        so an illegal call fails in every test, not only when the row happens to be in that state. False when
        the row is gone or in none of the guard's states (it moved on first).
        """
        if "state" in values:
            raise TypeError("update_sandbox: change the state with event=, not state=")
        if error is not None:
            values["error"] = error.model_dump(mode="json")
        guard: frozenset[SandboxState] | None = None if expect is None else frozenset(expect)
        if event is not None:
            if by is None:
                raise TypeError("update_sandbox: an event needs the actor firing it (by=)")
            allowed = SANDBOX_MACHINE.sources(event, by)
            for s in guard or ():
                SANDBOX_MACHINE.transition(s, event, by)  # raises for a state outside the table
            guard = allowed if guard is None else guard & allowed
        now = time.time()
        with self.tx() as c:
            q = sa.select(S.sandboxes.c.state, S.sandboxes.c.timeline).where(S.sandboxes.c.id == sandbox_id)
            r = c.execute(q.with_for_update()).first()
            if r is None or (guard is not None and SandboxState(r.state) not in guard):
                return False
            if event is not None and by is not None:
                values["state"] = SANDBOX_MACHINE.transition(SandboxState(r.state), event, by).value
            if phase is not None:
                entry = {"at": now, "phase": phase, **({} if detail is None else detail.model_dump(mode="json"))}
                values["timeline"] = [*r.timeline, entry]
            c.execute(S.sandboxes.update().where(S.sandboxes.c.id == sandbox_id).values(updated_at=now, **values))
        if event is not None and by is not None:
            change = SandboxChange(sandbox_id, event.value, by.value, r.state, values["state"], phase)
            for listener in self.listeners:
                with suppress(Exception):  # telemetry never fails a change that is already made
                    listener(change)
        return True


def _placement_row(
    c: sa.Connection, sandbox_id: str, tenant: str | None, now: float, *, accel_class: str | None, **values: Any
) -> bool:
    """The placement's claim, cold or warm: the tenant's quota checked, then the row's CAS from a state the
    sandbox table lets a placement claim from (quota.* raised; False when the row moved on meanwhile)."""
    if tenant is not None:
        _check_quota(c, sandbox_id, tenant, accel_class, int(values["count"]), int(values["pinned_mib"]))
    guard = SANDBOX_MACHINE.sources(SandboxEvent.CLAIM, SandboxActor.PLACEMENT)
    target = SANDBOX_MACHINE.transition(SS.SCHEDULING, SandboxEvent.CLAIM, SandboxActor.PLACEMENT)
    res = c.execute(
        S.sandboxes.update()
        .where(S.sandboxes.c.id == sandbox_id, S.sandboxes.c.state.in_([g.value for g in guard]))
        .values(accel_class=accel_class, state=target.value, updated_at=now, **values)
    )
    return bool(res.rowcount == 1)


def _check_quota(
    c: sa.Connection, sandbox_id: str, tenant: str, accel_class: str | None, count: int, pinned_mib: int
) -> None:
    """Raise `quota.*` if admitting this placement takes `tenant` over its quota (nothing is written)."""
    t = c.execute(sa.select(S.tenants.c.quota).where(S.tenants.c.name == tenant).with_for_update()).first()
    if t is None:
        return  # a tenant with no record (an admin's create for a name never registered) has no quota
    q = Quota.from_json(t.quota or {})
    s = S.sandboxes
    mine = sa.and_(
        s.c.tenant == tenant,
        s.c.id != sandbox_id,
        s.c.state.in_([SS.PLACING.value, *(h.value for h in HELD_STATES)]),
    )
    n, pinned = c.execute(
        sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(s.c.pinned_mib), 0)).where(mine)
    ).one()
    if q.max_sandboxes is not None and n + 1 > q.max_sandboxes:
        raise _quota("quota.sandboxes", tenant, "concurrent sandboxes", q.max_sandboxes, int(n), 1)
    if q.max_pinned_mib is not None and pinned + pinned_mib > q.max_pinned_mib:
        raise _quota("quota.pinned_memory", tenant, "MiB of pinned memory", q.max_pinned_mib, int(pinned), pinned_mib)
    limit = q.max_accelerators.get(accel_class or "")
    if limit is not None:
        used = c.execute(
            sa.select(sa.func.coalesce(sa.func.sum(s.c.count), 0)).where(mine, s.c.accel_class == accel_class)
        ).scalar_one()
        if used + count > limit:
            raise _quota("quota.accelerators", tenant, f"{accel_class} accelerators", limit, int(used), count)


def _quota(code: str, tenant: str, what: str, limit: int, used: int, asked: int) -> CubeError:
    return CubeError(
        code,
        f"tenant {tenant} may hold {limit} {what}; {used} in use, this request asks for {asked}",
        "scheduler",
        {"limit": limit, "in_use": used, "requested": asked},
        429,
    )


@dataclass
class NodeAdmitted:
    sent_at: float  # of the summary these claims are relative to
    devices: dict[str, int] = field(default_factory=dict)  # group key -> devices
    memory_mib: int = 0


@dataclass(frozen=True)
class Placement:
    """A live sandbox's devices and lockable memory on its node."""

    node: str
    group_key: str | None
    count: int
    pinned_mib: int
    cubelet_created_at: float | None  # Cubelet clock; None while placing or before the Cubelet answered

    def unseen_by(self, sent_at: float) -> bool:
        """Whether a summary the node sent at `sent_at` (its clock) cannot show this placement (as `_unseen`)."""
        return self.cubelet_created_at is None or self.cubelet_created_at >= sent_at


@dataclass(frozen=True)
class HeartbeatRecorded:
    node: str
    state: str  # the operator state
    returned: bool  # new, or stale until this beat
    digest: str  # of the summary now stored
    received_at: float
    sent_at: float


class NodeLiveness(NamedTuple):
    """A node row's cheap columns: enough to tell whether its summary changed, and its clocks either way (a tuple:
    a reload builds one per node, 10,000 at a time)."""

    name: str
    digest: str | None  # None: written before digests, or by a path that does not set one (always re-read)
    state: str
    received_at: float
    sent_at: float


def summary_digest(body: Mapping[str, Any]) -> str:
    """A stored heartbeat body's digest without its `sent_at` (canonical JSON: key order does not matter)."""
    rest = {k: v for k, v in body.items() if k != "sent_at"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _view(r: sa.Row[Any]) -> NodeView:
    """A node row's view. The clocks come from the columns: a beat that repeated the summary renewed only them,
    so the JSON's own `sent_at` may be older."""
    view = view_from_heartbeat(r.heartbeat, r.received_at, r.state)
    view.sent_at = float(r.sent_at)
    view.summary_digest = r.summary_digest
    return view


def _unseen() -> sa.ColumnElement[bool]:
    """Placements the node's last summary (sent at `sent_at`) cannot show yet. A warm claim is none: its
    sandbox's devices and memory were held (warm) in every summary since it was advertised."""
    s, n = S.sandboxes, S.nodes
    placed = sa.or_(
        s.c.state == SS.PLACING.value,
        sa.and_(
            s.c.state.in_([h.value for h in HELD_STATES]),
            sa.or_(s.c.cubelet_created_at.is_(None), s.c.cubelet_created_at >= n.c.sent_at),
        ),
    )
    return sa.and_(placed, s.c.warm_id.is_(None))  # a warm claim's devices and memory were held before it


def _admitted_memory(c: sa.Connection, node: str | None) -> dict[str, int]:
    s, n = S.sandboxes, S.nodes
    q = (
        sa.select(s.c.node, sa.func.sum(s.c.pinned_mib))
        .select_from(s.join(n, s.c.node == n.c.name))
        .where(_unseen(), s.c.pinned_mib > 0)
        .group_by(s.c.node)
    )
    if node is not None:
        q = q.where(s.c.node == node)
    return {name: int(total) for name, total in c.execute(q)}


def _admitted(c: sa.Connection, node: str | None) -> dict[str, dict[str, int]]:
    """Devices placed or being placed that the node's last summary (sent at `sent_at`) cannot show."""
    s, n = S.sandboxes, S.nodes
    unseen = _unseen()
    q = (
        sa.select(s.c.node, s.c.group_key, sa.func.sum(s.c.count))
        .select_from(s.join(n, s.c.node == n.c.name))
        .where(unseen)
        .group_by(s.c.node, s.c.group_key)
    )
    if node is not None:
        q = q.where(s.c.node == node)
    out: dict[str, dict[str, int]] = {}
    for node_name, key, total in c.execute(q):
        out.setdefault(node_name, {})[key] = int(total)
    return out
