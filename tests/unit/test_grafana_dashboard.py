"""The Grafana dashboard in deploy/grafana uses only series the servers export, with labels they carry."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from cubeaccel.cubelet.metrics import CubeletMetrics
from cubeaccel.master.metrics import MasterMetrics
from cubeaccel.master.service import CubeMaster
from cubeaccel.master.store import MasterStore
from tests.support.cubelet_harness import Node

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "cubeaccel.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
PROMQL_WORDS = {"by", "on", "le", "sum", "rate", "group_left", "histogram_quantile", "label_values"}


def exported(*registries: CollectorRegistry) -> dict[str, set[str]]:
    """Series name → its label names, from the registries' own descriptions (nothing needs to have happened)."""
    out: dict[str, set[str]] = {}
    for reg in registries:
        for collector in list(reg._collector_to_names):
            labels = set(getattr(collector, "_labelnames", ()))
            for family in collector.collect():
                labels |= {k for s in family.samples for k in s.labels} | set(getattr(family, "_labelnames", ()))
                for suffix in SUFFIXES.get(family.type, ("",)):
                    extra = {"le"} if suffix == "_bucket" else set()
                    out.setdefault(family.name + suffix, set()).update(labels | extra)
    return out


def exprs(dash: dict[str, Any]) -> list[str]:
    found = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    found += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return found


def test_every_series_and_label_in_the_dashboard_exists(tmp_path: Path) -> None:
    node = Node.create(tmp_path, "2xh100")
    master = CubeMaster(MasterStore(str(tmp_path / "m.db")))
    series = exported(CubeletMetrics(node.cubelet).registry, MasterMetrics(master).registry)
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "cubeaccel" and len(dash["panels"]) > 10
    used: set[str] = set()
    for expr in exprs(dash):
        names = set(re.findall(r"\bcubeaccel_[a-z0-9_]+", expr))
        used |= names
        assert names, f"a panel that shows none of our series: {expr}"
        missing = names - set(series)
        assert not missing, f"{expr}: no such series {missing}"
        have = set().union(*(series[n] for n in names)) | {"job", "instance", "le"}
        labels = set(re.findall(r"([A-Za-z_]+)\s*(?:=~|!=|=)\s*\"", expr))
        for group in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr):
            labels |= {x.strip() for x in group.split(",") if x.strip()}
        assert labels - have - PROMQL_WORDS == set(), f"{expr}: labels no series of it has"
    assert len(used) >= 20  # most of what is exported is on the dashboard
    node.cubelet.store.close()
    master.store.close()
