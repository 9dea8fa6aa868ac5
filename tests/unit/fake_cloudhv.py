"""A stand-in `cloud-hypervisor` process: its REST API on a unix socket and its event monitor file.

Cloud Hypervisor cannot be installed on these machines (not in Debian 12, KVM-only), so CloudHypervisorVmm is
tested against this: the documented endpoints and shapes (`/api/v1/vmm.ping`, `vm.create`, `vm.boot`,
`vm.add-device {path,id}` → `{id,bdf}`, `vm.remove-device {id}`, `vm.shutdown`, `vmm.shutdown`, `vm.info`) and
the event monitor's back-to-back pretty-printed JSON objects (`device-removed` with `properties.id`).
`FAKE_CH_IGNORE_REMOVE=1` plays a guest that never completes an unplug.

Run: python fake_cloudhv.py --api-socket path=SOCK --event-monitor path=FILE
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import UnixStreamServer
from typing import Any

_SYSFS_DEV = re.compile(r"/sys/bus/pci/devices/([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])/?")


class State:
    def __init__(self, events_path: str) -> None:
        self.events_path = events_path
        self.config: dict[str, Any] | None = None
        self.state = "Created"
        self.devices: dict[str, str] = {}
        self.next_slot = 6
        self.lock = threading.Lock()
        self.ignore_remove = os.environ.get("FAKE_CH_IGNORE_REMOVE") == "1"

    def event(self, source: str, event: str, properties: dict[str, str] | None = None) -> None:
        now = time.time()
        obj = {
            "timestamp": {"secs": int(now), "nanos": int(now % 1 * 1e9)},
            "source": source,
            "event": event,
            "properties": properties,
        }
        with self.lock, open(self.events_path, "a") as f:
            f.write(json.dumps(obj, indent=2) + "\n\n")


class _Server(UnixStreamServer, HTTPServer):
    def server_bind(self) -> None:
        UnixStreamServer.server_bind(self)
        self.server_name, self.server_port = "cloud-hypervisor", 0


def make_handler(st: State, server_ref: list[_Server]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def address_string(self) -> str:
            return "api"

        def log_message(self, *args: object) -> None:
            pass

        def _reply(self, code: int, body: dict[str, Any] | None = None, text: str = "") -> None:
            data = json.dumps(body).encode() if body is not None else text.encode()
            self.send_response(code)
            if body is not None:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if data:
                self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            n = int(self.headers.get("Content-Length") or 0)
            if not n:
                return {}
            data = json.loads(self.rfile.read(n))
            return data if isinstance(data, dict) else {}

        def do_GET(self) -> None:
            if self.path == "/api/v1/vmm.ping":
                self._reply(200, {"build_version": "fake", "version": "v40.0-fake", "pid": os.getpid(), "features": []})
            elif self.path == "/api/v1/vm.info" and st.config is not None:
                self._reply(
                    200, {"config": st.config, "state": st.state, "memory_actual_size": st.config["memory"]["size"]}
                )
            else:
                self._reply(404, text="not found")

        def do_PUT(self) -> None:
            endpoint = self.path.removeprefix("/api/v1/")
            body = self._body()
            if endpoint == "vm.create":
                if st.config is not None:
                    return self._reply(500, text="VM already created")
                if "kernel" not in (body.get("payload") or {}) or "size" not in (body.get("memory") or {}):
                    return self._reply(400, text="payload.kernel and memory.size are required")
                st.config = body
                return self._reply(204)
            if endpoint == "vm.boot":
                if st.config is None:
                    return self._reply(500, text="VM not created")
                st.state = "Running"
                st.event("vm", "booted")
                return self._reply(204)
            if endpoint == "vm.add-device":
                m = _SYSFS_DEV.fullmatch(str(body.get("path", "")))
                dev_id = str(body.get("id") or f"_vfio{st.next_slot}")
                if st.state != "Running" or m is None or dev_id in st.devices:
                    return self._reply(500, text="Error adding device to the VM")
                bdf = f"0000:00:{st.next_slot:02x}.0"
                st.next_slot += 1
                st.devices[dev_id] = bdf
                return self._reply(200, {"id": dev_id, "bdf": bdf})
            if endpoint == "vm.remove-device":
                dev_id = str(body.get("id"))
                if dev_id not in st.devices:
                    return self._reply(500, text="Error removing device from the VM")
                if not st.ignore_remove:

                    def later() -> None:
                        time.sleep(0.05)  # the guest's ACPI eject takes a moment
                        st.devices.pop(dev_id, None)
                        st.event("vm", "device-removed", {"id": dev_id})

                    threading.Thread(target=later, daemon=True).start()
                return self._reply(204)
            if endpoint == "vm.shutdown":
                st.state = "Shutdown"
                st.event("vm", "shutdown")
                return self._reply(204)
            if endpoint == "vmm.shutdown":
                st.event("vmm", "shutdown")
                threading.Thread(target=server_ref[0].shutdown, daemon=True).start()
                return self._reply(204)
            return self._reply(404, text="not found")

    return Handler


def main(argv: list[str]) -> int:
    opts = {argv[i]: argv[i + 1].removeprefix("path=") for i in range(0, len(argv) - 1, 2)}
    st = State(opts["--event-monitor"])
    ref: list[_Server] = []
    server = _Server(opts["--api-socket"], make_handler(st, ref))
    ref.append(server)
    st.event("vmm", "starting")
    server.serve_forever()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
