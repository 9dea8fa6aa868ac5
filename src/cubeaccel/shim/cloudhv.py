"""`CloudHypervisorVmm`: the same `Vmm` protocol over Cloud Hypervisor's REST API on a unix socket.

Endpoints used (Cloud Hypervisor's documented API, `/api/v1`): `vmm.ping`, `vm.create` (memory `prefault: true`),
`vm.boot`, `vm.add-device {path, id}` → `{id, bdf}`, `vm.remove-device {id}`, `vm.shutdown`, `vmm.shutdown`.
Removal is confirmed only by the event monitor's `device-removed` event (`--event-monitor path=FILE`), never by
the 204 of `vm.remove-device`. Cloud Hypervisor passes through VFIO devices only (`path` is the host device's
sysfs directory); it cannot be installed on these machines, so this driver is tested against a fake server that
reproduces the API (tests/unit/fake_cloudhv.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any

import httpx

from cubeaccel.host import vmmproc as find
from cubeaccel.model.device import PciAddress
from cubeaccel.model.errors import CubeError
from cubeaccel.shim.vmm import Attached, ExitInfo, VmConfig, Vmm, reap, stop_child, vmm_error

API = "http://localhost/api/v1"


def vm_config(cfg: VmConfig) -> dict[str, Any]:
    """The `vm.create` body. Pure, so tests can read it."""
    return {
        "cpus": {"boot_vcpus": cfg.vcpus, "max_vcpus": cfg.vcpus},
        "memory": {"size": cfg.memory_mib * 1024 * 1024, "prefault": True, "shared": False},
        "payload": {"kernel": str(cfg.kernel), "initramfs": str(cfg.initrd), "cmdline": cfg.cmdline},
        "serial": {"mode": "File", "file": str(cfg.state_dir / "console.log")},
        "console": {"mode": "Off"},
    }


def parse_events(text: str) -> list[dict[str, Any]]:
    """The event monitor writes JSON objects back to back (pretty-printed); decode them one after another."""
    dec = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return out  # a partly written last object: read again later
        if isinstance(obj, dict):
            out.append(obj)


class CloudHypervisorVmm:
    kind = "cloud-hypervisor"

    def __init__(self, cfg: VmConfig, binary: list[str] | None = None) -> None:
        self.cfg = cfg
        self.binary = binary or ["cloud-hypervisor"]
        self.api_socket = cfg.state_dir / "ch-api.sock"
        self.events_path = cfg.state_dir / "ch-events.json"
        self._proc: subprocess.Popen[bytes] | None = None
        self._client: httpx.Client | None = None
        self._exit: ExitInfo | None = None
        self._attached: dict[str, Attached] = {}

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise vmm_error("vmm.not_started", "VMM not started")
        return self._proc.pid

    def _api(self, method: str, endpoint: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        if self._client is None:
            raise vmm_error("vmm.not_started", "API not connected")
        try:
            resp = self._client.request(method, f"{API}/{endpoint}", json=body)
        except httpx.HTTPError as e:
            raise vmm_error("vmm.api_failed", f"{endpoint}: {type(e).__name__}: {e}") from e
        if resp.status_code >= 400:
            raise vmm_error(
                "vmm.api_error", f"{endpoint}: HTTP {resp.status_code}: {resp.text[:300]}", status_code=resp.status_code
            )
        if not resp.content:
            return {}
        data = resp.json()
        return data if isinstance(data, dict) else {}

    def start(self) -> None:
        sd = self.cfg.state_dir
        sd.mkdir(parents=True, exist_ok=True)
        self.api_socket.unlink(missing_ok=True)
        self.events_path.write_text("")
        env = {**os.environ, find.ENV_SANDBOX: self.cfg.sandbox_id, find.ENV_DEVICES: ";".join(self.cfg.device_ids)}
        argv = [
            find.argv0_tag("cloud-hypervisor", self.cfg.sandbox_id),
            *self.binary[1:],
            "--api-socket",
            f"path={self.api_socket}",
            "--event-monitor",
            f"path={self.events_path}",
        ]
        with (sd / "vmm.log").open("ab") as log:
            self._proc = subprocess.Popen(
                argv,
                executable=self.binary[0],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        self._client = httpx.Client(transport=httpx.HTTPTransport(uds=str(self.api_socket)), timeout=10.0)
        deadline = time.monotonic() + 30.0
        while True:
            if self.poll_exit() is not None:
                raise vmm_error("vmm.start_failed", "cloud-hypervisor exited during start")
            try:
                self._api("GET", "vmm.ping")
                break
            except CubeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self._api("PUT", "vm.create", vm_config(self.cfg))
        self._api("PUT", "vm.boot")

    def add_device(self, qdev_id: str, driver: str, properties: dict[str, str], slot: int) -> Attached:
        if driver != "vfio-pci" or "host" not in properties:
            raise vmm_error(
                "vmm.unsupported_device", f"cloud-hypervisor passes through VFIO devices only, not {driver}"
            )
        bdf = PciAddress.parse(properties["host"])  # validated before it becomes a sysfs path
        info = self._api("PUT", "vm.add-device", {"path": f"/sys/bus/pci/devices/{bdf}/", "id": qdev_id})
        att = Attached(str(info.get("id", qdev_id)), "pci", info.get("bdf"))
        self._attached[att.qdev_id] = att
        return att

    def request_remove(self, qdev_id: str) -> None:
        self._api("PUT", "vm.remove-device", {"id": qdev_id})

    def removed_ids(self) -> set[str]:
        try:
            events = parse_events(self.events_path.read_text())
        except OSError:
            return set()
        return {
            str(e.get("properties", {}).get("id"))
            for e in events
            if e.get("event") == "device-removed" and isinstance(e.get("properties"), dict)
        }

    def wait_removed(self, qdev_ids: set[str], timeout_s: float) -> set[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            done = qdev_ids & self.removed_ids()
            if done == qdev_ids or time.monotonic() > deadline or self.poll_exit() is not None:
                for qid in done:
                    self._attached.pop(qid, None)
                return done
            time.sleep(0.02)

    def poll_exit(self) -> ExitInfo | None:
        self._exit = reap(self._proc, self._exit)
        return self._exit

    def stop(self, grace_s: float = 5.0) -> ExitInfo:
        if self._proc is None:
            raise vmm_error("vmm.not_started", "VMM not started")
        if self.poll_exit() is None:

            def ask() -> None:
                self._api("PUT", "vm.shutdown")
                self._api("PUT", "vmm.shutdown")

            self._exit = stop_child(self._proc, self.poll_exit, ask, grace_s)
        if self._client is not None:
            self._client.close()
            self._client = None
        assert self._exit is not None
        return self._exit


def _conforms(vmm: CloudHypervisorVmm) -> Vmm:
    """mypy --strict checks here that CloudHypervisorVmm implements the Vmm protocol."""
    return vmm
