"""E2B's default template through the real e2b SDK: `Sandbox.create()` with no template asks for `base`, a CPU-only
template, and gets a real MicroVM (front door → CubeMaster → Cubelet → shim) with no device in its path; a command
runs; the kill goes through the ordinary release path, which completes with no device reserved, reset or scrubbed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2b import Sandbox

from cubeaccel.images.manifest import Manifest
from tests.e2b.test_e2b_vm import NODE, opts, start_stack, stop_stack
from tests.support.e2b_sdk import run_check
from tests.support.master_harness import example
from tests.support.poll import poll

pytestmark = pytest.mark.vm


def base_template(image: Manifest) -> dict[str, Any]:
    """The shipped `base` example, pinned to this run's guest image (as `cubeaccel up` pins it)."""
    return example(
        "base",
        spec__guest__image__digest=image.image_digest,
        spec__guest__kernel__version=image.kernel_release,
        spec__guest__kernel__digest=image.vmlinux.sha256,
        spec__guest__modules_img__kernel_version=image.kernel_release,
        spec__guest__modules_img__digest=image.modules_img.sha256,
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, guest_image: Manifest) -> Iterator[dict[str, Any]]:
    s = start_stack(tmp_path_factory.mktemp("e2b-cpu"), guest_image)
    s["master"].client.register_template(base_template(guest_image))
    s["key"] = s["master"].tenant_key
    try:
        yield s
    finally:
        stop_stack(s)


def test_sandbox_create_without_a_template_runs_a_command_in_a_cpu_only_microvm(stack: dict[str, Any]) -> None:
    master, cubelet = stack["master"].client, stack["cubelet"].client
    devices_before = {d.id: d.state for d in cubelet.devices()}
    sbx = Sandbox.create(**opts(stack))  # no template: the SDK sends its default, `base`
    try:
        row = master.sandbox(sbx.sandbox_id)
        assert row.template.name == "base" and row.state == "running" and row.node == NODE
        assert row.device_ids == [] and row.accel_class == "none"
        assert cubelet.reservation(sbx.sandbox_id).devices == []
        assert {d.id: d.state for d in cubelet.devices()} == devices_before  # the edu device stayed free
        r = sbx.commands.run("echo hi")
        assert (r.stdout, r.exit_code) == ("hi\n", 0)
        r = sbx.commands.run("cat /sys/bus/pci/devices/*/vendor")
        assert "0x1234" not in r.stdout  # nothing was hot-plugged: no edu device in the guest
        cursor = max((e.seq for e in cubelet.events(limit=10000).events), default=0)
    finally:
        sbx.kill()
    poll(lambda: master.sandbox(sbx.sandbox_id).state == "deleted", 60, what="the kill's release completes")
    mine = [e for e in cubelet.events(since=cursor, limit=10000).events if e.sandbox_id == sbx.sandbox_id]
    kinds = [e.kind for e in mine]
    assert kinds.index("teardown_started") < kinds.index("reservation_closed")  # VMM gone, then closed
    assert not any(e.device_id for e in mine)  # no device in its release path either
    assert {d.id: d.state for d in cubelet.devices()} == devices_before


@pytest.mark.parametrize("line", ["2.15.2", "2.45.1"])
def test_older_sdk_lines_default_to_base_and_get_a_cpu_only_sandbox(stack: dict[str, Any], line: str) -> None:
    seen = run_check(line, Path(__file__).with_name("sdk_default_template_check.py"), [], stack["key"], stack["fd"].url)
    assert (seen["stdout"], seen["exit_code"], seen["killed"]) == ("hi\n", 0, True)
    row = stack["master"].client.sandbox(seen["sandbox_id"])
    assert row.template.name == "base" and row.device_ids == [] and row.accel_class == "none"
