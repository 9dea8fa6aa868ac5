"""A guest that writes its serial console without end does not fill the host's disk (issue 30 #4): the shim keeps
`console.log` under its cap (`CUBEACCEL_CONSOLE_LOG_MAX_BYTES`) by rotating the tail into `console.log.1`."""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cubeaccel.images.manifest import Manifest
from tests.support.poll import poll
from tests.support.vmm_cleanup import kill_started_vmms
from tests.vm.conftest import ShimRun
from tests.workload_client import WorkloadClient

pytestmark = pytest.mark.vm
CAP = 64 * 1024
WRITTEN = 3 * 1024 * 1024


@pytest.fixture
def capped_vm(tmp_path: Path, guest_image: Manifest, monkeypatch: pytest.MonkeyPatch) -> Iterator[ShimRun]:
    monkeypatch.setenv("CUBEACCEL_CONSOLE_LOG_MAX_BYTES", str(CAP))  # the shim inherits the test's environment
    sandbox = f"con-{uuid.uuid4().hex[:10]}"
    spec = {
        "sandbox_id": sandbox,
        "devices": [],
        "memory_mib": 256,
        "vcpus": 1,
        "pin_memory": True,
        "image_manifest": str(guest_image.directory / "manifest.json"),
        "start": "cold",
        "state_dir": str(tmp_path / "state"),
        "report": {"file": str(tmp_path / "reports.jsonl")},
        "detach_timeout_s": 5.0,
        "workload": True,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run = ShimRun(sandbox, tmp_path / "spec.json", tmp_path / "reports.jsonl", tmp_path / "state")
    run.workload_token = secrets.token_urlsafe(24)
    run.start()
    try:
        run.wait_for("workload_ready", 240)
        yield run
    finally:
        if run.proc is not None and run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        kill_started_vmms(tmp_path)


def test_root_flooding_the_serial_console_keeps_the_log_under_its_cap(capped_vm: ShimRun) -> None:
    log = capped_vm.state_dir / "console.log"
    http = httpx.Client(
        transport=httpx.HTTPTransport(uds=str(capped_vm.state_dir / "workload.sock")),
        base_url="http://workload",
        timeout=240.0,
    )
    assert capped_vm.workload_token is not None
    wl = WorkloadClient(http, capped_vm.workload_token)
    try:
        s = wl.run(f"head -c {WRITTEN} /dev/zero | tr '\\0' x > /dev/ttyS0; echo done", user="root")
        assert s.output() == b"done\n"
    finally:
        http.close()
    rotated = log.with_name("console.log.1")
    # what the guest wrote is not all on disk: at most two caps plus one check interval's output (generous here)
    poll(lambda: log.stat().st_size <= CAP or None, 10.0)  # the last look after the write
    assert rotated.exists() and rotated.stat().st_size <= CAP
    assert log.stat().st_size + rotated.stat().st_size < WRITTEN // 4
    assert rotated.stat().st_mode & 0o077 == 0
    assert capped_vm.terminate() == 0
