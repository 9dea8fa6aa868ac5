"""Who had which device: journal events become custody entries; the entries answer who held a device when."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.cubelet.device_audit import entries_of
from cubeaccel.cubelet.store import Event
from cubeaccel.model.audit_trail import DEVICE_ACTIONS, holding_at
from cubeaccel.model.states import DeviceEvent


def ev(kind: str, at: float, device: str | None, sandbox: str | None, event: str | None = None, **d: Any) -> Event:
    return Event(0, at, kind, device, sandbox, event, None, None, "cubelet", None, d)


def entry(e: Event) -> list[dict[str, Any]]:
    return [{"at": e.at, "action": a, "outcome": o, **f} for a, o, f in entries_of(e)]


def test_every_device_event_has_an_audit_action() -> None:
    assert set(DEVICE_ACTIONS) == set(DeviceEvent)
    for e in DeviceEvent:
        assert [a for a, _, _ in entries_of(ev("transition", 1.0, "d0", "sb", e.value))][-1] == DEVICE_ACTIONS[e]


def test_the_assignment_names_device_sandbox_tenant_template_and_contract() -> None:
    (got,) = entry(
        ev("transition", 5.0, "d0", "sb-1", "reserve", tenant="acme", template="t", contract_digest="sha256:ab")
    )
    assert (got["action"], got["device"], got["sandbox"], got["tenant"], got["template"], got["contract_digest"]) == (
        "device:assigned",
        "d0",
        "sb-1",
        "acme",
        "t",
        "sha256:ab",
    )


def life(device: str, sandbox: str, tenant: str, t0: float) -> list[dict[str, Any]]:
    """A tenant's whole time on a device, as the journal records it."""
    return [
        *entry(ev("transition", t0, device, sandbox, "reserve", tenant=tenant)),
        *entry(ev("transition", t0 + 1, device, sandbox, "attach_succeeded")),
        *entry(ev("shim_report", t0 + 5, None, sandbox, "vmm_exited", pid=4, status=0)),
        *entry(ev("transition", t0 + 6, device, sandbox, "release_confirmed", reset=True)),
        *entry(ev("scrub_finished", t0 + 7, device, sandbox, ok=True, method="bar", reset_after="ok")),
        *entry(ev("transition", t0 + 8, device, None, "revalidated")),
    ]


def test_who_held_a_device_at_a_time_and_who_held_it_last() -> None:
    log = [*life("d0", "sb-a", "acme", 100.0), *life("d1", "sb-x", "other", 101.0), *life("d0", "sb-b", "beta", 200.0)]
    at = holding_at(log, "d0", 103.0)
    assert (at["holder"]["tenant"], at["holder"]["sandbox"]) == ("acme", "sb-a")
    assert [e["action"] for e in at["holder"]["trail"]] == [
        "device:assigned",
        "device:attached",
        "vmm:exited",  # the sandbox's VMM: named by sandbox, in the holding's trail
        "device:reset",
        "device:released",
    ]
    between = holding_at(log, "d0", 150.0)  # released, scrubbed, allocatable: nobody holds it
    assert between["holder"] is None and between["previous"]["tenant"] == "acme"
    assert holding_at(log, "d0", 204.0)["holder"]["tenant"] == "beta"
    assert holding_at(log, "d0", 50.0) == {"device": "d0", "at": 50.0, "holder": None, "previous": None}


def test_a_quarantine_does_not_end_the_holding() -> None:
    log = [
        *entry(ev("transition", 1.0, "d0", "sb-a", "reserve", tenant="acme")),
        *entry(ev("transition", 2.0, "d0", "sb-a", "teardown")),
        *entry(ev("transition", 3.0, "d0", "sb-a", "quarantine")),  # holder stuck: release never proven
        *entry(ev("transition", 9.0, "d0", None, "recover", who="ops")),
    ]
    assert holding_at(log, "d0", 5.0)["holder"]["tenant"] == "acme"
    assert holding_at(log, "d0", 9.5)["holder"] is None


def test_a_warm_claim_hands_the_holding_from_the_node_to_the_tenant_at_one_instant() -> None:
    log = [
        *entry(ev("transition", 1.0, "d0", "warm-1", "reserve", tenant=None, template="t")),
        *entry(ev("transition", 2.0, "d0", "warm-1", "attach_succeeded")),
        *entry(ev("device_claimed", 5.0, "d0", "sb-a", warm_id="warm-1", tenant="acme", template="t")),
        *entry(ev("transition", 8.0, "d0", "sb-a", "release_confirmed")),
    ]
    assert (holding_at(log, "d0", 4.9)["holder"]["sandbox"], holding_at(log, "d0", 4.9)["holder"]["tenant"]) == (
        "warm-1",
        None,
    )
    at = holding_at(log, "d0", 5.0)
    assert (at["holder"]["sandbox"], at["holder"]["tenant"], at["holder"]["assigned_at"]) == ("sb-a", "acme", 5.0)
    assert (at["previous"]["sandbox"], at["previous"]["released_at"]) == ("warm-1", 5.0)
    assert at["holder"]["trail"][0]["warm_id"] == "warm-1"
    assert holding_at(log, "d0", 9.0)["previous"]["tenant"] == "acme"


@given(st.lists(st.tuples(st.booleans(), st.sampled_from(["acme", "beta", None])), min_size=1, max_size=8))
def test_whoever_the_log_says_claimed_a_device_holds_it_until_its_release_and_nobody_else(
    lives: list[tuple[bool, str | None]],
) -> None:
    """A device's successive lives, each a warm sandbox (claimed or not) or a cold start: at every instant the
    holder is the last assignment's or claim's sandbox and tenant, and none covers the time between lives."""
    log: list[dict[str, Any]] = []
    expect: list[tuple[float, float, str, str | None]] = []  # from, until, sandbox, tenant
    for i, (warm, tenant) in enumerate(lives):
        t0 = 10.0 * i
        first = f"warm-{i}" if warm else f"sb-{i}"
        log += entry(ev("transition", t0, "d0", first, "reserve", tenant=None if warm else tenant))
        log += entry(ev("transition", t0 + 1, "d0", first, "attach_succeeded"))
        if warm and tenant is not None:
            log += entry(ev("device_claimed", t0 + 3, "d0", f"sb-{i}", warm_id=first, tenant=tenant))
            expect += [(t0, t0 + 3, first, None), (t0 + 3, t0 + 6, f"sb-{i}", tenant)]
        else:
            expect.append((t0, t0 + 6, first, None if warm else tenant))
        log += entry(ev("transition", t0 + 6, "d0", None, "release_confirmed"))
    for start, until, sandbox, tenant in expect:
        for at in (start, (start + until) / 2, until - 0.01):
            holder = holding_at(log, "d0", at)["holder"]
            assert holder is not None and (holder["sandbox"], holder["tenant"]) == (sandbox, tenant)
        between = holding_at(log, "d0", until + 0.5)["holder"]
        assert between is None or between["assigned_at"] == until  # the claim's instant, or nobody
