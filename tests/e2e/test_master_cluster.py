"""CubeMaster + 3 Cubelets as real processes over HTTP, each with different simulated devices.

n1: 4x H100 + 2x T4   n2: 2x H100   n3: 2x A100
Templates: cuda12-h100 (1 GiB pinned so these hosts can lock it; the default for gpu), cuda12-h100-huge
(4 TiB pinned, the most a template may ask: no node can), edu-demo (class accelerator, emulated backend;
the default for accelerator).
"""

from __future__ import annotations

import re
from typing import Any

import httpx

from cubeaccel.master.scheduler import CONTRACT_REASONS, FILTERS, contract
from tests.support.master_harness import Cluster
from tests.support.poll import poll

PROFILES = {"n1": "4xh100,2xt4", "n2": "2xh100", "n3": "2xa100"}


def holders(cl: Cluster) -> dict[str, str]:
    """device id → sandbox id, as every Cubelet reports it."""
    out = {}
    for node, p in cl.cubelets.items():
        for d in p.client.devices():
            if d.sandbox_id:
                out[f"{node}/{d.id}"] = d.sandbox_id
    return out


def test_gpu_shorthand_alone_places_on_a_node_that_has_it_and_the_cubelet_agrees(c: Cluster) -> None:
    s = c.c.create({"gpu": "H100:1"})
    assert s.state == "running" and s.node in ("n1", "n2") and len(s.device_ids) == 1
    assert s.template is not None and s.template.name == "cuda12-h100"
    assert [p.phase for p in s.timeline] == ["requested", "path", "scheduled", "reserved"]
    assert s.timeline[1].model_dump()["path"] == "cold"  # no warm pool in this cluster (docs/warm.md)
    assert holders(c) == {f"{s.node}/{s.device_ids[0]}": s.id}
    dev = c.cubelets[s.node].client.devices()
    assert {d.state for d in dev if d.sandbox_id == s.id} == {"attached"}


def settle(cl: Cluster) -> None:
    """Wait until every node's summary shows the placements made so far: no pending claims, and as many devices
    not free as the Cubelets say sandboxes hold (a claim can clear before the heartbeat that counts it)."""

    def settled() -> bool:
        nodes = cl.c.nodes()
        held = sum(n.total - n.allocatable for n in nodes)
        return all(g.claimed == 0 for n in nodes for g in n.groups) and held == len(holders(cl))

    poll(settled)


def test_placement_prefers_numa_locality_then_packing_and_takes_the_first_alternative_that_fits(c: Cluster) -> None:
    first = c.c.create({"gpu": "H100:2"})
    assert first.node == "n1"  # n1 has 3 H100s on NUMA node 0; n2's two sit on different NUMA nodes
    settle(c)
    alt = c.c.create(
        {
            "accelerators": [
                {
                    "class": "gpu",
                    "count": 6,
                    "model": "H100",
                    "alternatives": [{"class": "gpu", "count": 2, "model": "H100"}],
                }
            ]
        }
    )
    assert alt.node == "n2" and alt.count == 2 and len(alt.device_ids) == 2  # packing: emptier n1 kept
    sel = c.c.create(
        {
            "accelerators": [
                {"class": "gpu", "selector": "device.model.startsWith('H100') && device.architecture == 'hopper'"}
            ]
        }
    )
    assert sel.node == "n1"
    placed = holders(c)
    assert len(placed) == 5 and sorted(placed.values()).count(alt.id) == 2
    settle(c)
    assert c.reasons({"gpu": "H100:2"}) == {
        "n1": "insufficient_devices",
        "n2": "insufficient_devices",
        "n3": "labels_mismatch(model)",
    }


# Every reason a node can be refused for: one per filter, the contract filter's per check_node code.
ALL_REASONS = {f.__name__ for f in FILTERS if f is not contract} | set(CONTRACT_REASONS.values())


def test_every_rejection_reason_is_reachable(c: Cluster) -> None:
    reached: set[str] = set()

    def reasons(body: dict[str, Any]) -> dict[str, str]:
        got = c.reasons(body)
        reached.update(r.split("(")[0] for r in got.values())
        return got

    assert reasons({"gpu": "B200:1"}) == dict.fromkeys(PROFILES, "labels_mismatch(model)")
    assert reasons({"gpu": "T4:1"}) == {
        "n1": "device_incompatible",
        "n2": "labels_mismatch(model)",
        "n3": "labels_mismatch(model)",
    }
    assert c.reasons({"gpu": "A100:1"})["n3"] == "device_incompatible"
    assert reasons({"accelerators": [{"class": "gpu", "selector": "int(device.memory_gib) >= 141"}]}) == dict.fromkeys(
        PROFILES, "selector_mismatch"
    )
    assert reasons({"gpu": "H100:1", "template": "cuda12-h100-huge"}) == {
        "n1": "pinned_memory",
        "n2": "pinned_memory",
        "n3": "labels_mismatch(model)",
    }
    assert reasons({"gpu": "H100:8"}) == {
        "n1": "insufficient_devices",
        "n2": "insufficient_devices",
        "n3": "labels_mismatch(model)",
    }
    assert reasons({"gpu": "accelerator:1"}) == dict.fromkeys(PROFILES, "class_missing")
    c.c.node_verb("n2", "drain", "alice", "maintenance")
    try:
        assert reasons({"gpu": "H100:5"}) == {
            "n1": "insufficient_devices",
            "n2": "node_draining",
            "n3": "labels_mismatch(model)",
        }
        assert c.c.create({"gpu": "H100:2"}).node == "n1"  # n2 would pack better, but it is draining
    finally:
        c.c.node_verb("n2", "undrain")
    # Host readiness, the device limit, backend, hot-plug, guest kernel, image and modules.img come from what a
    # node reports; a node reporting each in turn is sent by hand.
    guest = {
        "digest": "sha256:" + "1" * 64,
        "kernel_release": "5.10.0-1-amd64",
        "kernel_digests": ["sha256:" + "2" * 64],
        "modules_img_digest": "sha256:" + "3" * 64,
    }
    fake: dict[str, Any] = {
        "node": "fake",
        "cubelet_url": "http://127.0.0.1:9",
        "version": "0",
        "sent_at": 0.0,
        "pinnable_memory_mib": 1 << 20,
        "ready": False,
        "host_problems": [{"code": "host.no_iommu", "message": "no IOMMU groups"}],
        "guest_images": [guest],
        "hotplug": ["pcie-root-port-acpi"],
        "capacity": {
            "node": "fake",
            "backends": ["vfio"],
            "total": 1,
            "groups": [
                {
                    "class": "gpu",
                    "labels": {
                        "model": "H100-PCIe-80GB",
                        "memory_gib": "80",
                        "backend": "vfio",
                        "vendor": "nvidia",
                        "architecture": "hopper",
                    },
                    "total": 1,
                    "by_state": {"allocatable": 1},
                    "allocatable_by_numa": {"0": 1},
                }
            ],
        },
    }

    def on_fake(**changes: Any) -> str:
        """The fake node's reason for an 8-H100 sandbox once it reports `changes`."""
        fake.update(changes)
        httpx.put(f"{c.master.url}/v1/nodes/fake", json=fake, auth=c.master.node_auth("fake")).raise_for_status()
        why = c.reasons({"gpu": "H100:8"})["fake"]
        reached.add(why)
        return why

    assert on_fake() == "host_not_ready"
    assert on_fake(ready=True, host_problems=[], max_devices_per_sandbox=4) == "device_limit"
    assert on_fake(max_devices_per_sandbox=None) == "kernel_incompatible"
    h100 = next(i for i in c.c.nodes() if i.node == "n1").guest_images[0].model_dump()  # the guest cuda12-h100 pins
    assert on_fake(guest_images=[{**h100, "modules_img_digest": guest["modules_img_digest"]}]) == "modules_img_missing"
    assert on_fake(guest_images=[{**h100, "digest": guest["digest"]}]) == "image_missing"
    assert on_fake(hotplug=[]) == "hotplug_unsupported"
    fake["capacity"]["backends"] = ["emulated"]
    assert on_fake() == "backend_unsupported"
    poll(lambda: c.reasons({"gpu": "H100:8"})["fake"] == "node_stale")
    reached.add("node_stale")
    assert reached == ALL_REASONS


def test_rejection_message_counts_reasons_per_node(c: Cluster) -> None:
    err = c.refused({"gpu": "H100:5"})
    assert err.status == 409 and err.layer == "scheduler"
    assert re.search(r"H100: 0/\d nodes: 2 insufficient_devices, 1 labels_mismatch\(model\)", err.message)
    assert err.details["tried"][0]["nodes"]["n2"]["detail"] == "5 wanted, free: H100-PCIe-80GB=2"
