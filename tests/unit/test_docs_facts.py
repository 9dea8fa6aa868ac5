"""Facts the docs state that the code decides: the heartbeat's fields and the default lifetimes. Each is read out
of the doc's own sentence, so a doc that drifts from the code fails here."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from cubeaccel.cli.root import app
from cubeaccel.frontdoor.mapping import DEFAULT_TIMEOUT_S
from cubeaccel.master.scheduler import CONTRACT_REASONS, FILTERS, contract
from cubeaccel.master.service import MasterConfig
from cubeaccel.wire.heartbeat import Heartbeat

ROOT = Path(__file__).resolve().parents[2]


def _doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def heartbeat_body_keys(master_md: str) -> set[str]:
    """The keys of the body that docs/master.md's "Heartbeat body" paragraph spells out, `{"node", ...}`."""
    para = master_md.split("Heartbeat body (sent by Cubelet", 1)[1].split("\n\n", 1)[0]
    body = re.search(r"`\{(.*?)\}`", para, re.S)
    assert body is not None, "the paragraph lost its {...} body"
    top_level = re.sub(r"\[\{.*?\}\]", "[]", body.group(1), flags=re.S)  # host_problems' items are not keys
    return set(re.findall(r'"(\w+)"', top_level))


def test_the_heartbeat_body_in_master_md_is_the_heartbeat_model() -> None:
    envelope = {"v"}  # every body's version, documented once in docs/api.md
    assert heartbeat_body_keys(_doc("master.md")) == set(Heartbeat.model_fields) - envelope


def test_the_docs_give_one_rule_for_empty_node_facts_the_refusing_one() -> None:
    """check_node refuses a node that reports no guest images (tests/unit/test_contract_stages.py); the rule it
    replaced, "empty means not reported, the check is skipped", must not survive in a doc."""
    master, decisions = _doc("master.md"), _doc("decisions.md")
    assert "absent or empty means the node has none" in master
    assert 'Absent or empty means "none", never "skip the check"' in decisions
    for doc in (master, decisions):
        assert not re.search(r"`kernels`/`images`\s+(?:in a heartbeat\s+)?mean", doc)
        assert "skipped for that node" not in doc and "skipped, not failed" not in doc


def _seconds(pattern: str, text: str) -> float:
    found = re.findall(pattern, text)
    assert len(found) == 1, f"{pattern!r} should match once, matched {found}"
    return float(found[0].replace(",", ""))


def test_cubemasters_default_lifetime_in_decisions_md_is_the_code_default() -> None:
    serve = typer.main.get_command(app).commands["master"].commands["serve"]  # type: ignore[attr-defined]
    option = next(p for p in serve.params if "--default-timeout" in getattr(p, "opts", ()))
    cli_default = option.default
    assert cli_default == MasterConfig().default_lifetime_s
    stated = _seconds(r"--default-timeout` \(([\d,]+) s", _doc("decisions.md"))
    assert stated == cli_default


def test_e2bs_omitted_timeout_in_decisions_md_is_the_front_doors() -> None:
    stated = _seconds(r"An omitted E2B `timeout` is ([\d,]+) s", _doc("decisions.md"))
    assert stated == DEFAULT_TIMEOUT_S


def test_decisions_md_does_not_restate_a_lifetime_default_elsewhere() -> None:
    """Each default said once: a second copy is the one that goes stale."""
    doc = _doc("decisions.md")
    assert re.findall(r"\b3,?600 s\b", doc) == ["3600 s"]
    assert "else 24 h" not in doc and "`MasterConfig.default_timeout_s`" not in doc


def test_master_mds_reason_table_lists_every_scheduler_reason_once() -> None:
    section = _doc("master.md").split("## Scheduling", 1)[1]
    table = next(p for p in section.split("\n\n") if p.startswith("| reason |"))
    cells = [row.split("|")[1] for row in table.splitlines() if row.startswith("| `")]
    listed = [re.sub(r"\(.*\)", "", name) for cell in cells for name in re.findall(r"`([\w()]+)`", cell)]
    reasons = {f.__name__ for f in FILTERS if f is not contract} | set(CONTRACT_REASONS.values())
    assert sorted(listed) == sorted(reasons)
