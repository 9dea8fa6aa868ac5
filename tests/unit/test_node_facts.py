"""Node facts on the wire: guest images and hot-plug paths, and the simulated node's image set."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cubeaccel.cubelet.shim_driver import simulated_guest_images
from cubeaccel.model.node_facts import GuestImageFact, parse_guest_images, parse_hotplug, pinned_image
from tests.support.contract_builders import edu, h100

DIGESTS = st.from_regex(r"sha256:[0-9a-f]{64}", fullmatch=True)


def test_the_simulated_node_holds_exactly_the_guests_the_example_templates_pin() -> None:
    """Simulated clusters schedule the examples; an edited example must move the simulated set with it."""
    from cubeaccel.master.up import EXAMPLES
    from cubeaccel.wire.templates import load_template

    base = load_template(str(EXAMPLES / "base.yaml"))  # E2B's default, on the userland image
    assert (pinned_image(h100()), pinned_image(edu()), pinned_image(base)) == simulated_guest_images()


@given(
    DIGESTS,
    st.from_regex(r"[0-9]\.[0-9]{1,2}\.[0-9]-[0-9]{1,3}-[a-z]{3,8}", fullmatch=True),
    st.lists(DIGESTS, min_size=1, max_size=4),
    DIGESTS,
)
def test_a_guest_image_fact_round_trips_through_json(digest: str, release: str, kernels: list[str], mods: str) -> None:
    fact = GuestImageFact(digest, release, tuple(kernels), mods)
    assert parse_guest_images([fact.to_json()]) == (fact,)


def test_absent_facts_mean_none_not_unknown() -> None:
    assert (parse_guest_images(None), parse_hotplug(None)) == ((), frozenset())


@pytest.mark.parametrize("raw", [{}, [1], [{"digest": "sha256:" + "0" * 64}], "x"])
def test_malformed_guest_images_are_value_errors(raw: object) -> None:
    with pytest.raises(ValueError):
        parse_guest_images(raw)
