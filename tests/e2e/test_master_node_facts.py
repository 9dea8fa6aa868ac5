"""Node facts through CubeMaster: real Cubelets report their guest images, and the scheduler refuses a node that
lacks the kernel (or image) a template pins, naming the layer."""

from __future__ import annotations

from typing import Any

from tests.support.master_harness import Cluster, example
from tests.support.poll import poll

PROFILES = {"a": "2xh100", "b": "2xh100"}
K99 = {
    "digest": "sha256:" + "9" * 64,
    "kernel_release": "6.1.0-99-cloud-amd64",
    "kernel_digests": ["sha256:" + "8" * 64],
    "modules_img_digest": "sha256:" + "7" * 64,
}
GUEST_IMAGES = {"b": [K99]}  # a: the default simulated set (what the examples pin); b: only a 6.1.0-99 guest


def pinned_to(name: str, image: dict[str, Any]) -> dict[str, Any]:
    doc = example("cuda12-h100", metadata__name=name, spec__memory__size_mib=1024)
    doc["spec"]["guest"] = {
        "image": {"digest": image["digest"]},
        "kernel": {"version": image["kernel_release"], "digest": image["kernel_digests"][0]},
        "modules_img": {"kernel_version": image["kernel_release"], "digest": image["modules_img_digest"]},
    }
    return doc


def test_each_node_reports_the_guest_images_it_holds(c: Cluster) -> None:
    nodes = {n.node: n for n in c.c.nodes()}
    assert [i.model_dump(mode="json") for i in nodes["b"].guest_images] == [K99]
    assert "6.1.0-57-amd64" in {i.kernel_release for i in nodes["a"].guest_images}
    assert nodes["a"].hotplug == nodes["b"].hotplug == ["pcie-root-port-acpi"]


def test_a_template_pinning_a_kernel_no_node_has_is_refused_with_layer_guest_kernel(c: Cluster) -> None:
    c.c.register_template(pinned_to("cuda12-k98", {**K99, "kernel_release": "6.1.0-98-cloud-amd64"}))
    err = c.refused({"gpu": "H100:1", "template": "cuda12-k98"})
    assert err.code == "schedule.unschedulable"
    nodes = err.details["tried"][-1]["nodes"]
    assert {n: d["reason"] for n, d in nodes.items()} == {"a": "kernel_incompatible", "b": "kernel_incompatible"}
    assert nodes["a"]["detail"].startswith("guest_kernel: expected 6.1.0-98-cloud-amd64 (sha256:8888")
    assert nodes["b"]["detail"].endswith("found 6.1.0-99-cloud-amd64")
    assert c.c.sandboxes("running") == []


def test_each_template_lands_only_where_its_kernel_is(c: Cluster) -> None:
    c.c.register_template(pinned_to("cuda12-k99", K99))
    on_b = c.c.create({"gpu": "H100:1", "template": "cuda12-k99"})
    assert on_b.node == "b"
    poll(lambda: c.c.sandbox(on_b.id).state == "running")  # b's simulated shim holds that guest
    on_a = c.c.create({"gpu": "H100:2"})  # the default cuda12-h100 pins 6.1.0-27: only a has it
    assert on_a.node == "a"
    assert c.reasons({"gpu": "H100:1"}) == {"a": "insufficient_devices", "b": "kernel_incompatible"}
