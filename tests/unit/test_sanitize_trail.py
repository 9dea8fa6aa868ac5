"""A device never goes from a tenant to `allocatable` without a recorded sanitizing stage (model/sanitize.py), and
every scrub's evidence is typed the same at both ends (wire/scrub.py)."""

from __future__ import annotations

from typing import Any

from cubeaccel.agent.scrub import ScrubResult
from cubeaccel.model.sanitize import leftover_tenant, unsanitized_returns
from cubeaccel.wire.scrub import ScrubReport


def tr(event: str, to: str, actor: str = "cubelet", **details: Any) -> dict[str, Any]:
    return {
        "kind": "transition",
        "event": event,
        "to_state": to,
        "actor": actor,
        "sandbox_id": "sb",
        "details": details,
    }


RELEASE = tr("release_confirmed", "released", scrub_policy="trusted-vm", vmm_started=True)


def test_a_tenant_then_allocatable_without_a_scrub_is_a_violation() -> None:
    trail = [tr("reserve", "reserved"), tr("teardown", "releasing"), RELEASE, tr("revalidated", "allocatable")]
    assert [v["tenant"] for v in unsanitized_returns(trail)] == ["sb"]


def test_each_sanitizing_stage_clears_the_device() -> None:
    scrubbed = {"kind": "scrub_finished", "details": {"ok": True}}
    failed = {"kind": "scrub_finished", "details": {"ok": False}}
    none = tr("release_confirmed", "released", scrub_policy="none", vmm_started=True)
    never = tr("release_confirmed", "released", scrub_policy="trusted-vm", vmm_started=False)
    back = tr("revalidated", "allocatable")
    assert unsanitized_returns([tr("reserve", "reserved"), RELEASE, scrubbed, back]) == []
    assert unsanitized_returns([tr("reserve", "reserved"), none, back]) == []
    assert unsanitized_returns([tr("reserve", "reserved"), never, back]) == []
    assert unsanitized_returns([tr("reserve", "reserved"), tr("recover", "allocatable", "operator")]) == []
    assert len(unsanitized_returns([tr("reserve", "reserved"), RELEASE, failed, back])) == 1
    retried = tr("retry", "released", scrub_policy="trusted-vm")
    assert len(unsanitized_returns([tr("reserve", "reserved"), RELEASE, failed, retried, back])) == 1
    assert unsanitized_returns([tr("validated", "allocatable")]) == []  # a device that never had a tenant


def test_an_operators_recover_to_scrub_leaves_the_taint_to_the_scrub() -> None:
    failed = {"kind": "scrub_finished", "details": {"ok": False}}
    to_scrub = tr("recover_scrub", "released", "operator", scrub_owed=True)
    back = tr("revalidated", "allocatable")
    assert leftover_tenant([tr("reserve", "reserved"), RELEASE, failed]) == "sb"
    assert leftover_tenant([tr("reserve", "reserved"), RELEASE, failed, to_scrub]) == "sb"
    assert len(unsanitized_returns([tr("reserve", "reserved"), RELEASE, failed, to_scrub, back])) == 1
    scrubbed = {"kind": "scrub_finished", "details": {"ok": True}}
    assert unsanitized_returns([tr("reserve", "reserved"), RELEASE, failed, to_scrub, scrubbed, back]) == []
    assert leftover_tenant([tr("reserve", "reserved"), RELEASE, scrubbed]) is None
    assert leftover_tenant([tr("validated", "allocatable")]) is None


def test_the_agents_result_reads_as_the_typed_evidence() -> None:
    r = ScrubResult(ok=True, method="cuda", bytes_zeroed=1 << 30, bytes_verified=40960, pages_sampled=10)
    ev = ScrubReport.model_validate(r.to_json()).evidence()
    assert ev["pattern"] == "0x00" and ev["pages_sampled"] == 10 and ev["readback_ok"] is True
    bad = ScrubReport.model_validate({**r.to_json(), "pages_nonzero": 2}).evidence()
    assert bad["readback_ok"] is False
    assert ScrubReport.model_validate({"ok": True, "method": "bar"}).evidence()["readback_ok"] is False  # no samples
