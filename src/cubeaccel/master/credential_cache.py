"""A replica's copy of the live node credentials, so a signed heartbeat is checked without a transaction of its own.

Every signed node request read the node's credential row first: at 10,000 nodes that is 5,000 short transactions a
second beside the heartbeats themselves. A replica keeps the generations it has seen valid, and drops all of them
when the credentials' change marker (`meta.node_credentials_changed`, rewritten in the same transaction as every
re-enrolment and revocation, on whichever replica) differs from the one it last read. The marker is read at most
every `ttl_s`, so a credential revoked or replaced elsewhere stops working on this replica within `ttl_s`
(on the replica that revoked it, at once). Only valid credentials are kept: an unknown or revoked one is read from
the row every time, so a node enrolled on another replica is accepted at its first request.
"""

from __future__ import annotations

import secrets
import threading
import time

import sqlalchemy as sa

from cubeaccel.master import schema as S
from cubeaccel.master.store import MasterStore


def mark_credentials_changed(c: sa.Connection) -> None:
    """Inside the transaction that re-enrols or revokes: every replica's copy is dropped at its next look."""
    c.execute(S.meta.update().where(S.meta.c.key == S.CREDENTIALS_CHANGED_KEY).values(value=secrets.token_hex(8)))


class NodeCredentialCache:
    def __init__(self, store: MasterStore, ttl_s: float = 0.25) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._valid: dict[str, int] = {}  # node → the generation its row held, not revoked
        self._marker: str | None = None
        self._checked_at = float("-inf")
        self._epoch = 0  # bumped at every drop: a row read before one is not kept after it

    def drop(self) -> None:
        with self._lock:
            self._valid.clear()
            self._epoch += 1

    def generation(self, node: str, fresh: bool = False) -> int | None:
        """The node's live credential generation (None: never enrolled or revoked); `fresh`: read from its row
        (a node presenting a newer generation than the copy's was re-enrolled on another replica just now)."""
        self._check_marker()
        with self._lock:
            if not fresh and (gen := self._valid.get(node)) is not None:
                return gen
            epoch = self._epoch
        with self.store.tx() as c:
            r = c.execute(sa.select(S.node_credentials).where(S.node_credentials.c.node == node)).first()
        if r is None or r.revoked:
            with self._lock:
                self._valid.pop(node, None)
            return None
        with self._lock:
            if self._epoch == epoch:
                self._valid[node] = int(r.generation)
        return int(r.generation)

    def _check_marker(self) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._checked_at <= self.ttl_s:
                return
            self._checked_at = now  # one reader per interval; the others use the copy meanwhile
        with self.store.tx() as c:
            marker = c.execute(
                sa.select(S.meta.c.value).where(S.meta.c.key == S.CREDENTIALS_CHANGED_KEY)
            ).scalar_one_or_none()
        with self._lock:
            if marker != self._marker:
                self._valid.clear()
                self._epoch += 1
                self._marker = marker
