"""Tables for the terminal: device inventory and event trails."""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(width=160)


def device_table(devices: list[dict[str, Any]], title: str = "devices") -> Table:
    t = Table(title=title)
    for col in ("address", "model", "NUMA", "state", "sandbox", "reason"):
        t.add_column(col)
    for d in devices:
        t.add_row(
            d["address"],
            d["labels"].get("model", "?"),
            str(d["numa_node"]),
            d["state"],
            d["sandbox_id"] or "-",
            d["reason"] or "-",
        )
    return t


def event_table(events: list[dict[str, Any]], title: str = "events") -> Table:
    t = Table(title=title)
    for col in ("seq", "time", "kind", "device", "sandbox", "event", "from → to", "actor", "reason"):
        t.add_column(col)
    for e in events:
        when = dt.datetime.fromtimestamp(e["at"], dt.UTC).strftime("%H:%M:%S.%f")[:-3]
        move = f"{e['from_state'] or ''} → {e['to_state']}" if e["to_state"] else ""
        t.add_row(
            str(e["seq"]),
            when,
            e["kind"],
            e["device_id"] or "",
            e["sandbox_id"] or "",
            e["event"] or "",
            move,
            e["actor"],
            e["reason"] or "",
        )
    return t
