"""The Cubelet journal's schema and its forward migrations. `PRAGMA user_version` is the version."""

from __future__ import annotations

SCHEMA_VERSION = 5

MIGRATIONS: dict[int, str] = {
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
}
