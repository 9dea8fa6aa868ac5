"""`cubeaccel nodes` and `cubeaccel node list|drain|undrain`: nodes as CubeMaster sees them."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from cubeaccel.cli import output
from cubeaccel.cli.master_access import (
    AsJson,
    MasterUrl,
    call_master,
)
from cubeaccel.cli.render import console
from cubeaccel.wire.master_api import NodeSummary, WarmPoolShown


def nodes_cmd(url: MasterUrl = None, as_json: AsJson = False) -> None:
    """Nodes, their state (ready / draining / stale) and free devices."""
    output.json_flag(as_json)
    nodes = call_master(url, lambda c: c.nodes())
    output.emit({"nodes": nodes}, lambda: console.print(_nodes_table(nodes)))


def _nodes_table(nodes: list[NodeSummary]) -> Table:
    t = Table(title="nodes")
    for col in ("node", "state", "heartbeat", "backends", "free/total", "devices", "warm"):
        t.add_column(col)
    for n in nodes:
        groups = ", ".join(f"{g.labels.get('model', g.accel_class)} {g.allocatable}/{g.total}" for g in n.groups)
        t.add_row(
            n.node,
            output.state(n.state),
            f"{n.last_heartbeat_age_s:.1f}s ago",
            ",".join(n.backends),
            f"{n.allocatable}/{n.total}",
            groups,
            _warm_cell(n.warm_pools),
        )
    return t


def _warm_cell(pools: list[WarmPoolShown]) -> str:
    """Per pool: warm/size, and how many are starting (refill)."""
    cells = []
    for p in pools:
        starting = f" +{p.starting} starting" if p.starting else ""
        cells.append(f"{p.template or p.key} {p.warm}/{p.size} warm{starting}")
    return ", ".join(cells) or "-"


node_app = typer.Typer(no_args_is_help=True, help="Nodes through CubeMaster: list, drain, undrain (admin key).")


@node_app.command("list")
def node_list(url: MasterUrl = None, as_json: AsJson = False) -> None:
    """The same as `cubeaccel nodes`."""
    nodes_cmd(url, as_json)


def _node_verb(verb: str, node: str, who: str | None, reason: str, url: str | None) -> None:
    r = call_master(url, lambda c: c.node_verb(node, verb, who or "operator", reason))
    # `who` in the reply is the authenticated identity CubeMaster recorded, not what was claimed.
    said = r.model_dump()  # drain/undrain add `state` and `who`; reconcile its own fields
    output.emit(
        r, lambda: console.print(f"node {node}: {said.get('state', verb)} (by {said.get('who', who)}: {reason})")
    )


@node_app.command("drain")
def node_drain(
    node: str,
    reason: Annotated[str, typer.Option(help="why (audited)")],
    who: Annotated[str | None, typer.Option(help="operator name (CubeMaster records the key's identity)")] = None,
    url: MasterUrl = None,
) -> None:
    """Stop placing new sandboxes on NODE; the ones running there keep running."""
    _node_verb("drain", node, who, reason, url)


@node_app.command("undrain")
def node_undrain(
    node: str,
    reason: Annotated[str, typer.Option(help="why (audited)")],
    who: Annotated[str | None, typer.Option(help="operator name (CubeMaster records the key's identity)")] = None,
    url: MasterUrl = None,
) -> None:
    """Place sandboxes on NODE again."""
    _node_verb("undrain", node, who, reason, url)


def register_top_level(root: typer.Typer) -> None:
    root.command("nodes")(nodes_cmd)
    root.add_typer(node_app, name="node")
