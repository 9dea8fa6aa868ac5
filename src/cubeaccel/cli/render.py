"""Tables for the terminal: device inventory and event trails (ids in full, states colored)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.table import Table

from cubeaccel.cli.output import console as make_console
from cubeaccel.cli.output import state

console = make_console()


def device_table(devices: list[dict[str, Any]], title: str = "devices") -> Table:
    t = Table(title=title)
    # The full id, never cut: it is what `device quarantine ID` takes. The other columns fold around it.
    t.add_column("id", no_wrap=True, min_width=max((len(d["id"]) for d in devices), default=2))
    t.add_column("address", no_wrap=True)
    for col in ("model", "NUMA"):
        t.add_column(col, overflow="fold")
    t.add_column("state", no_wrap=True)
    for col in ("sandbox", "reason"):
        t.add_column(col, overflow="fold")
    for d in devices:
        t.add_row(
            d["id"],
            d["address"],
            d["labels"].get("model", "?"),
            str(d["numa_node"]),
            state(d["state"]),
            d["sandbox_id"] or "-",
            d["reason"] or "-",
        )
    return t


def who(e: dict[str, Any]) -> str:
    """The actor, and for an operator's verb the person it named (`operator:alice`)."""
    person = (e.get("details") or {}).get("who")
    return f"{e['actor']}:{person}" if person else str(e["actor"])


def event_table(events: list[dict[str, Any]], title: str = "events") -> Table:
    t = Table(title=title)
    for col in ("seq", "time", "kind", "device", "sandbox", "event", "from → to", "who", "why"):
        t.add_column(col, overflow="fold")
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
            who(e),
            (e.get("details") or {}).get("why") or e["reason"] or "",
        )
    return t
