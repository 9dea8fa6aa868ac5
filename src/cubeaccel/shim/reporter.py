"""Delivering ShimReports to Cubelet: HTTP over its unix socket, or JSON lines appended to a file.

A report that cannot be delivered is retried briefly and then kept in the state dir's `undelivered.jsonl`:
Cubelet's reconcile reads host reality (find_vmm) anyway, so the shim never blocks teardown on Cubelet.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from cubeaccel.protocol.reports import ShimReport
from cubeaccel.transport.telemetry import outgoing_headers
from cubeaccel.wire.reports import ReportDetails, report_json

log = logging.getLogger("cubeaccel.shim")

REPORT_PATH = "/v1/shim-reports"


class Reporter:
    def __init__(
        self,
        sandbox_id: str,
        socket_path: Path | None,
        file_path: Path | None,
        state_dir: Path,
        retries: int = 3,
        start_id: str | None = None,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.start_id = start_id
        self.socket_path = socket_path
        self.file_path = file_path
        self.state_dir = state_dir
        self.retries = retries
        self.sent: list[ShimReport] = []

    def report(self, details: ReportDetails, device_ids: tuple[str, ...] = ()) -> ShimReport:
        """`details` is the kind's model (wire/reports.py): its kind names the report."""
        kind = details.kind
        r = ShimReport(self.sandbox_id, kind, device_ids, details.to_json(), time.time(), self.start_id)
        body = report_json(r)
        log.info("report", extra={"fields": {"sandbox_id": self.sandbox_id, "kind": kind.value, "devices": device_ids}})
        if self.file_path is not None:
            self._append(self.file_path, body)
        elif self.socket_path is not None and not self._post(body):
            self._append(self.state_dir / "undelivered.jsonl", body)
        self.sent.append(r)
        return r

    @staticmethod
    def _append(path: Path, body: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:  # one write per line: concurrent appenders do not interleave lines
            f.write(json.dumps(body) + "\n")

    def _post(self, body: dict[str, Any]) -> bool:
        assert self.socket_path is not None
        import httpx  # only in socket mode: keeps the shim's start-up light

        transport = httpx.HTTPTransport(uds=str(self.socket_path))
        headers = outgoing_headers()  # the request that started this sandbox, into Cubelet's log lines
        with httpx.Client(transport=transport, base_url="http://cubelet", timeout=5.0, headers=headers) as client:
            for attempt in range(self.retries):
                try:
                    resp = client.post(REPORT_PATH, json=body)
                    if resp.status_code < 500:
                        return resp.is_success
                except httpx.HTTPError:
                    pass
                time.sleep(0.1 * (attempt + 1))
        return False
