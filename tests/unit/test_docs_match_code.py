"""The docs that restate a list the code owns (report kinds and their fields, the journal's schema version, the
agent's methods) say what the code says. A list written twice drifts; only a test notices."""

from __future__ import annotations

import re
from pathlib import Path

from cubeaccel.cubelet.schema import SCHEMA_VERSION
from cubeaccel.protocol.agent_messages import METHODS
from cubeaccel.protocol.reports import ShimReportKind
from cubeaccel.wire.reports import ReportDetails

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _details_models() -> dict[ShimReportKind, type[ReportDetails]]:
    found: dict[ShimReportKind, type[ReportDetails]] = {}
    todo = list(ReportDetails.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "kind" in cls.__dict__:
            found[cls.kind] = cls
    return found


def _shim_md_rows() -> dict[str, str]:
    """`docs/shim.md`'s report table: each kind named in a row's first cell → the row's details cell."""
    rows: dict[str, str] = {}
    for line in (DOCS / "shim.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            for kind in re.findall(r"`(\w+)`", cells[0]):
                rows[kind] = cells[2]
    return rows


def test_shim_md_has_a_row_for_every_report_kind_naming_each_of_its_fields() -> None:
    rows = _shim_md_rows()
    models = _details_models()
    missing = [k.value for k in ShimReportKind if k.value not in rows]
    assert missing == []
    unnamed = {
        kind.value: sorted(f for f in model.model_fields if f"`{f}`" not in rows[kind.value])
        for kind, model in models.items()
    }
    assert {k: v for k, v in unnamed.items() if v} == {}


def test_api_md_names_every_report_kind() -> None:
    text = (DOCS / "api.md").read_text()
    listed = re.search(r"`kind` \(`([^`]+)`\)", text)
    assert listed is not None, "docs/api.md no longer lists the shim report kinds as `kind` (`a, b, …`)"
    named = {k.strip() for k in listed.group(1).replace("\n", " ").split(",")}
    assert named == {k.value for k in ShimReportKind}


def test_api_md_health_example_carries_the_journals_schema_version() -> None:
    text = (DOCS / "api.md").read_text()
    shown = re.findall(r'"schema_version": (\d+)', text)
    assert shown and all(int(v) == SCHEMA_VERSION for v in shown)


def test_agent_md_ready_event_lists_the_agents_methods() -> None:
    text = (DOCS / "agent.md").read_text()
    lists = re.findall(r'"methods":\[("[^\]]+)\]', text)
    assert lists, "docs/agent.md shows no ready event with its methods"
    for shown in lists:
        assert tuple(json_str.strip('"') for json_str in shown.split(",")) == METHODS
