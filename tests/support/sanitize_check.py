"""Applies model/sanitize.py's checker to every Cubelet journal a test left behind (tests/conftest.py)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from cubeaccel.model.sanitize import unsanitized_returns


def trails(db: Path) -> dict[str, list[dict[str, Any]]]:
    """Each device's events in order, as `Event.to_json()` shapes them (read-only; the Cubelet may still run)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    conn.row_factory = sqlite3.Row
    try:
        rows = conn.execute("SELECT * FROM events WHERE device_id IS NOT NULL ORDER BY seq").fetchall()
    finally:
        conn.close()
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["device_id"], []).append({**dict(r), "details": json.loads(r["details"])})
    return out


def violations(root: Path) -> list[str]:
    """`db: device from tenant to allocatable unsanitized` for every journal under `root`."""
    found: list[str] = []
    for db in sorted(root.rglob("cubelet.db")):
        try:
            per_device = trails(db)
        except sqlite3.DatabaseError:  # not a journal (a test's own file of that name), or no events table yet
            continue
        for device, trail in per_device.items():
            found += [f"{db}: {device}: {v}" for v in unsanitized_returns(trail)]
    return found
