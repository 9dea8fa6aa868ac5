"""Which nodes' warm pools a newer template version supersedes, and the pool CubeMaster asks for instead
(master/warm_versions.py): only a pool of a registered earlier version, on a fresh ready node, is rebuilt, keeping
its size and shape with the latest document's contract, memory and pinning."""

from __future__ import annotations

from cubeaccel.master.records import TemplateRecord
from cubeaccel.master.warm_versions import superseded, versions_of
from cubeaccel.model.contract import CompatibilityContract, freeze
from tests.support.contract_builders import template
from tests.unit.test_master_warm import node, pool

V1 = freeze(template(spec__memory__size_mib=1024))
V2 = freeze(template(spec__memory__size_mib=2048, metadata__version="2"))


def record(c: CompatibilityContract, seq: int) -> TemplateRecord:
    return TemplateRecord(c.template_name, c.template_version, seq, c.accel_class, c.digest, {}, 0.0)


VERSIONS = versions_of([record(V1, 1), record(V2, 2)], {"cuda12-h100": V2})


def test_a_pool_of_an_earlier_registered_version_is_rebuilt_from_the_latest_keeping_its_size_and_shape() -> None:
    (r,) = superseded([node(pool(contract_digest=V1.digest, vcpus=2, size=3))], VERSIONS, 1000.0, 10.0)
    assert (r.node, r.pool) == ("n", "k1")
    b = r.body
    assert (b.size, b.count, b.accel_class, b.vcpus, b.template) == (3, 1, "gpu", 2, "cuda12-h100")
    assert (b.contract.digest, b.memory_mib, b.pin_memory) == (V2.digest, 2048, V2.pin_memory)


def test_the_latest_an_unregistered_document_another_template_or_an_unfit_node_is_left_alone() -> None:
    assert superseded([node(pool(contract_digest=V2.digest))], VERSIONS, 1000.0, 10.0) == []
    assert superseded([node(pool(contract_digest="sha256:" + "0" * 64))], VERSIONS, 1000.0, 10.0) == []
    assert superseded([node(pool(contract_digest=V1.digest, template="other"))], VERSIONS, 1000.0, 10.0) == []
    assert superseded([node({**pool(contract_digest=V1.digest), "class": "fpga"})], VERSIONS, 1000.0, 10.0) == []
    assert superseded([node(pool(contract_digest=V1.digest), received_at=0.0)], VERSIONS, 1000.0, 10.0) == []
    drained = node(pool(contract_digest=V1.digest))
    drained.state = "draining"
    assert superseded([drained], VERSIONS, 1000.0, 10.0) == []
