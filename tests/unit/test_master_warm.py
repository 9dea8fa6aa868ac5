"""Which advertised warm sandboxes a create may claim (master/warm.py), and the heartbeat field they come from."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.master.selector import compile_selector
from cubeaccel.master.view import NodeView, view_from_heartbeat
from cubeaccel.master.warm import NO_POOL, POOL_EMPTY, WarmAsk, candidates, refilling, warm_rows
from cubeaccel.model.request import AcceleratorChoice
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.master_api import NodeVerbReply, SandboxList, WarmSandbox
from cubeaccel.wire.warm import WarmDrainReply, WarmVerbFailure
from tests.support.master_builders import group, h100_contract, heartbeat

CONTRACT = h100_contract(1024)
GPU = AcceleratorChoice("gpu", 1, model="H100")
H100 = group("H100", 8)["labels"]


def pool(ids: tuple[str, ...] = ("warm-" + "a" * 16, "warm-" + "b" * 16), **over: Any) -> dict[str, Any]:
    return {
        "key": "k1",
        "template": "cuda12-h100",
        "contract_digest": CONTRACT.digest,
        "class": "gpu",
        "count": 1,
        "memory_mib": 1024,
        "vcpus": 1,
        "pin_memory": CONTRACT.pin_memory,
        "network": None,
        "size": len(ids),
        "warm": len(ids),
        "starting": 0,
        "sandboxes": [{"id": i, "labels": H100} for i in ids],
        **over,
    }


def node(*pools: dict[str, Any], name: str = "n", received_at: float = 1000.0) -> NodeView:
    return view_from_heartbeat({**heartbeat(name, group("H100", 8)), "warm_pools": list(pools)}, received_at)


def find(views: list[NodeView], vcpus: int = 1, choice: AcceleratorChoice = GPU, sel: str | None = None) -> Any:
    selector = compile_selector(sel) if sel else None
    return candidates(views, WarmAsk([(choice, CONTRACT, selector)], None, vcpus, None), 1000.0, 10.0)


def test_a_matching_pool_offers_its_warm_ids_and_a_claimed_one_is_not_offered_again() -> None:
    v = node(pool())
    (c,), reason = find([v])
    assert reason == "" and c.warm_ids == ("warm-" + "a" * 16, "warm-" + "b" * 16) and c.node.name == "n"
    v.warm_claimed = frozenset(c.warm_ids)
    assert find([v]) == ([], POOL_EMPTY)


def test_a_pool_that_is_refilling_is_a_miss_that_counts_its_warm_starts_on_the_way() -> None:
    """A create does not wait for a warm start in flight (docs/decisions.md): it goes cold, saying how many."""
    empty = node(pool((), starting=2, size=2), pool((), starting=5, size=5, vcpus=2, key="k2"))
    assert find([empty]) == ([], POOL_EMPTY)
    assert refilling([empty], WarmAsk([(GPU, CONTRACT, None)], None, 1, None), 1000.0, 10.0) == 2  # its shape's only
    assert refilling([empty], WarmAsk([(GPU, CONTRACT, None)], None, 3, None), 1000.0, 10.0) == 0
    stale = node(pool((), starting=2), received_at=0.0)
    assert refilling([stale], WarmAsk([(GPU, CONTRACT, None)], None, 1, None), 1000.0, 10.0) == 0


def test_another_shape_model_or_selector_is_no_pool() -> None:
    assert find([node(pool())], vcpus=2)[1] == NO_POOL
    assert find([node(pool())], choice=AcceleratorChoice("gpu", 1, model="A100"))[1] == NO_POOL
    assert find([node(pool())], sel="int(device.memory_gib) > 1000")[1] == NO_POOL
    assert find([node(pool(contract_digest="sha256:" + "0" * 64))])[1] == NO_POOL


def test_a_stale_or_draining_node_offers_nothing() -> None:
    assert find([node(pool(), received_at=0.0)])[1] == NO_POOL
    drained = node(pool())
    drained.state = "draining"
    assert find([drained])[1] == NO_POOL


def test_the_node_with_most_free_warm_sandboxes_is_first() -> None:
    (a, b), _ = find([node(pool(("warm-" + "c" * 16,)), name="a"), node(pool(), name="b")])
    assert (a.node.name, b.node.name) == ("b", "a")


def test_warm_sandboxes_are_listed_in_state_warm() -> None:
    v = node(pool())
    v.warm_claimed = frozenset({"warm-" + "a" * 16})
    rows = warm_rows([v])
    assert [(r.state, r.node, r.claimed) for r in rows] == [("warm", "n", True), ("warm", "n", False)]
    # As the API lists them (`SandboxList`): the typed warm record, every field of it on the wire.
    listed = SandboxList(sandboxes=list(rows)).model_dump(mode="json", by_alias=True)["sandboxes"]
    assert [set(r) for r in listed] == [WARM_ROW_KEYS] * 2 and listed[0]["class"] == "gpu"
    again = SandboxList.model_validate({"sandboxes": listed}).sandboxes
    assert all(isinstance(r, WarmSandbox) for r in again) and list(again) == rows


WARM_ROW_KEYS = {
    *("id", "tenant", "state", "last_known_state", "node", "class", "count", "device_ids", "template", "request"),
    *("error", "timeline", "expires_at", "created_at", "updated_at", "pool", "labels", "claimed"),
}


def test_the_node_verbs_warm_answer_is_typed_either_way() -> None:
    drained = NodeVerbReply.model_validate({"node": "n", "warm": {"v": 1, "draining": True, "torn_down": ["w"]}})
    assert drained.warm == WarmDrainReply(draining=True, torn_down=["w"])
    failed = NodeVerbReply.model_validate({"node": "n", "warm": {"error": "cubelet.unreachable", "message": "x"}})
    assert failed.warm == WarmVerbFailure(error="cubelet.unreachable", message="x")
    assert failed.model_dump(mode="json")["warm"] == {"error": "cubelet.unreachable", "message": "x"}
    assert drained.model_dump(mode="json")["warm"] == {"v": 1, "draining": True, "torn_down": ["w"]}


def test_heartbeat_warm_pools_are_typed_and_an_older_cubelets_are_none() -> None:
    assert view_from_heartbeat(heartbeat("n"), 1.0).warm_pools == ()
    with pytest.raises(CubeError) as bad:
        view_from_heartbeat({**heartbeat("n"), "warm_pools": [pool(("sb-1",))]}, 1.0)
    assert bad.value.code == "node.invalid_heartbeat" and "warm_pools" in bad.value.message
    with pytest.raises(CubeError):
        view_from_heartbeat({**heartbeat("n"), "warm_pools": [{**pool(), "v": 2}]}, 1.0)


@given(st.integers(1, 4), st.integers(1, 4), st.sampled_from([512, 1024]), st.integers(1, 3), st.integers(1, 3))
def test_a_pool_matches_exactly_when_every_shape_field_is_the_requests(
    pool_vcpus: int, vcpus: int, pool_mem: int, pool_count: int, count: int
) -> None:
    v = node(pool(vcpus=pool_vcpus, memory_mib=pool_mem, count=pool_count))
    found, reason = find([v], vcpus=vcpus, choice=AcceleratorChoice("gpu", count))
    same = (pool_vcpus, pool_mem, pool_count) == (vcpus, 1024, count)
    assert bool(found) == same and reason == ("" if same else NO_POOL)
