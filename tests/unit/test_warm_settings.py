"""The node's warm pools and drain are kept in the Cubelet's journal (`WarmSettings`, docs/warm.md): a restarted
Cubelet keeps its pools and stays drained; a record it cannot read leaves it drained; a warm sandbox of no pool
kept here is released by reconcile. A real Cubelet and SQLite store on simulated devices, restarted in place."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from cubeaccel.cubelet.lifecycle import ReservationRequest
from cubeaccel.cubelet.warm import SETTINGS_KEY
from cubeaccel.model.reservation_states import ReservationPhase
from cubeaccel.wire.warm import WarmPoolSetting, WarmSettings
from tests.support.cubelet_harness import Node
from tests.support.poll import poll

SHAPE = ReservationRequest(count=1, template="t-1")


def _one_warm(node: Node) -> str:
    warm = node.cubelet.warm
    warm.set_pool(SHAPE, 1)
    (sid,) = warm.refill_once()
    poll(lambda: (r := node.cubelet.store.reservation(sid)) is not None and r.phase is ReservationPhase.WARM, 20)
    return sid


def test_the_pools_and_the_drain_outlive_a_restart(node: Node) -> None:
    sid = _one_warm(node)
    key = next(iter(node.cubelet.warm.pools))
    assert node.cubelet.warm.drain() == [sid]
    node.restart()
    warm = node.cubelet.warm
    assert list(warm.pools) == [key] and warm.pools[key].size == 1 and warm.draining
    assert warm.refill_once() == []  # drained: nothing started
    warm.undrain()
    node.restart()
    assert not node.cubelet.warm.draining and node.cubelet.warm.pools[key].size == 1


def test_a_restart_keeps_the_unclaimed_warm_sandboxes_claimable(node: Node) -> None:
    sid = _one_warm(node)
    node.restart()
    res, _ = node.cubelet.warm.claim("tenant-1", SHAPE)
    assert res.shim_id == sid and res.phase is ReservationPhase.RUNNING


def test_an_unreadable_record_leaves_the_node_drained_and_says_so(node: Node) -> None:
    with node.cubelet.store.tx() as t:
        t.set_meta(SETTINGS_KEY, '{"v": 2, "draining": false, "pools": []}')
    node.restart()
    assert node.cubelet.warm.draining and node.cubelet.warm.refill_once() == []
    assert "warm_settings_unreadable" in node.kinds()


def test_a_warm_sandbox_of_no_kept_pool_is_released_by_reconcile(node: Node) -> None:
    sid = _one_warm(node)
    with node.cubelet.store.tx() as t:  # as a journal written before pools were kept, or a shape dropped
        t.set_meta(SETTINGS_KEY, WarmSettings().model_dump_json(by_alias=True))
    repairs = node.restart()
    assert [(r.sandbox_id, r.why) for r in repairs if r.sandbox_id == sid] == [(sid, "warm.no_pool")]
    res = node.cubelet.store.reservation(sid)
    assert res is None or res.phase is ReservationPhase.RELEASING


settings_st = st.builds(
    lambda draining, pools: WarmSettings(draining=draining, pools=pools),
    st.booleans(),
    st.lists(
        st.builds(
            lambda size, count, cls, mem, vcpus, pin, tpl: WarmPoolSetting.model_validate(
                {
                    "size": size,
                    "count": count,
                    "class": cls,
                    "memory_mib": mem,
                    "vcpus": vcpus,
                    "pin_memory": pin,
                    "contract": None,
                    "template": tpl,
                }
            ),
            st.integers(0, 64),
            st.integers(0, 8),
            st.sampled_from([None, "gpu", "accelerator"]),
            st.integers(1, 1 << 20),
            st.integers(1, 256),
            st.booleans(),
            st.one_of(st.none(), st.text(max_size=20)),
        ),
        max_size=4,
    ),
)


@given(settings_st)
def test_the_record_reads_back_as_written(settings: WarmSettings) -> None:
    assert WarmSettings.model_validate_json(settings.model_dump_json(by_alias=True)) == settings


@pytest.mark.parametrize(
    "raw",
    ['{"v": 2}', '{"draining": "yes"}', '{"pools": [{"size": 65}]}', '{"pools": [{"size": 1, "colour": 1}]}', "[]"],
)
def test_a_record_of_another_shape_is_refused_whole(raw: str) -> None:
    with pytest.raises(ValidationError):
        WarmSettings.model_validate_json(raw)
