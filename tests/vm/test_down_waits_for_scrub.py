"""`cubeaccel down` (`end_sandboxes`) returns only once every device its sandboxes held is scrubbed: a scrub VM that
outlives its Cubelet runs unrecorded (25 s of it was seen after `down`), beside the next start's reconcile
scrubbing the same device again."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2b import Sandbox

from cubeaccel.images.manifest import Manifest
from cubeaccel.master.up import end_sandboxes
from tests.e2b.test_e2b_vm import TEMPLATE, opts, start_stack, stop_stack

pytestmark = pytest.mark.vm


def test_down_waits_until_the_released_device_is_scrubbed(tmp_path: Path, guest_image: Manifest) -> None:
    s = start_stack(tmp_path / "stack", guest_image)
    try:
        s["key"] = s["master"].tenant_key
        sbx = Sandbox.create(TEMPLATE, **opts(s))
        assert sbx.commands.run("true").exit_code == 0
        up_dir = tmp_path / "up"  # what `up` keeps for `down`: the node's token and the admin key
        up_dir.mkdir()
        (up_dir / "node-local.token").write_text(s["cubelet"].token)
        (up_dir / "admin.key").write_text(s["master"].admin_key)
        listen = s["cubelet"].extra[s["cubelet"].extra.index("--listen") + 1]
        assert end_sandboxes(s["master"].url, f"http://{listen}", up_dir, deadline_s=240) == []
        devices = s["cubelet"].client.request("GET", "/v1/devices")["devices"]
        assert {d["id"]: d["state"] for d in devices if d["state"] != "allocatable"} == {}
    finally:
        stop_stack(s)
