"""The Cubelet journal's schema and its forward migrations. `PRAGMA user_version` is the version.

A migration is SQL (statements split on `;`) or, where rows must be rewritten, a function of the connection;
either runs inside the one transaction that also sets the new version.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable

from cubeaccel.model.checkpoint import ReservationCheckpoint
from cubeaccel.protocol.errors import CubeError

SCHEMA_VERSION = 6


def _v6_checkpoint(conn: sqlite3.Connection) -> None:
    """`reservations.facts` (a free-form dict) becomes `reservations.checkpoint` (a versioned
    `ReservationCheckpoint`); the keys no decision read are dropped (`checkpoint.UNREAD_FACTS`)."""
    conn.execute("""ALTER TABLE reservations ADD COLUMN checkpoint TEXT NOT NULL DEFAULT '{"v": 1}'""")
    for sandbox_id, facts in conn.execute("SELECT sandbox_id, facts FROM reservations").fetchall():
        try:
            checkpoint = ReservationCheckpoint.from_facts(json.loads(facts))
        except ValueError as e:  # also json's decode error; the whole migration rolls back
            raise CubeError(
                code="store.migration_failed",
                message=f"reservation {sandbox_id}: its facts do not convert to a checkpoint: {e}",
                layer="cubelet",
                details={"sandbox_id": sandbox_id, "facts": facts[:2000]},
                status=500,
            ) from e
        conn.execute(
            "UPDATE reservations SET checkpoint=? WHERE sandbox_id=?", (json.dumps(checkpoint.to_json()), sandbox_id)
        )
    conn.execute("ALTER TABLE reservations DROP COLUMN facts")


MIGRATIONS: dict[int, str | Callable[[sqlite3.Connection], None]] = {
    1: """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE devices (
        id TEXT PRIMARY KEY,
        address TEXT NOT NULL,
        backend TEXT NOT NULL,
        accel_class TEXT NOT NULL,
        identity TEXT NOT NULL,
        numa_node INTEGER NOT NULL,
        iommu_group INTEGER,
        expected_driver TEXT,
        labels TEXT NOT NULL,
        state TEXT NOT NULL,
        generation INTEGER NOT NULL,
        reason TEXT,
        sandbox_id TEXT,
        updated_at REAL NOT NULL
    );
    CREATE TABLE reservations (
        sandbox_id TEXT PRIMARY KEY,
        params TEXT NOT NULL,
        device_ids TEXT NOT NULL,
        phase TEXT NOT NULL,
        created_at REAL NOT NULL,
        expires_at REAL
    );
    CREATE TABLE events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        kind TEXT NOT NULL,
        device_id TEXT,
        sandbox_id TEXT,
        event TEXT,
        from_state TEXT,
        to_state TEXT,
        actor TEXT NOT NULL,
        reason TEXT,
        details TEXT NOT NULL
    );
    CREATE INDEX events_device ON events(device_id, seq);
    """,
    2: """
    ALTER TABLE reservations ADD COLUMN facts TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE reservations ADD COLUMN releasing_since REAL;
    CREATE INDEX devices_sandbox ON devices(sandbox_id);
    """,
    3: """
    ALTER TABLE devices ADD COLUMN original_driver TEXT;
    """,
    4: """
    CREATE INDEX events_sandbox ON events(sandbox_id, seq);
    """,
    5: """
    ALTER TABLE devices ADD COLUMN aer_baseline INTEGER;
    """,
    6: _v6_checkpoint,
}
