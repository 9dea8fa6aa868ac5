"""The scrub's evidence on the wire: what the scrub VM's agent did to one device, as its shim reports it in
`scrub_finished` (details `result`, beside the scrub VM's `image_digest`) and as Cubelet records it
(docs/scrub.md). Both ends read it through this model: the shim before it reports, Cubelet before it judges.
Lenient (a newer agent may say more); the evidence fields are typed and bounded."""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictBool, StrictStr

from cubeaccel.wire.base import Count, Finite, LenientMessage

# What the event journal and the audit log keep of every scrub (the agent's whole result goes to the journal too).
# What the agent's result says of a scrub; the journal adds the timings, the audit log the VM's own facts.
RESULT_FIELDS = ("method", "pattern", "bytes_zeroed", "bytes_verified", "pages_sampled", "pages_nonzero", "readback_ok")
EVIDENCE_FIELDS = (*RESULT_FIELDS, "zero_ms", "verify_ms")


class ScrubReport(LenientMessage):
    """The agent's `ScrubResult` (agent/scrub.py) for one device."""

    ok: StrictBool = False
    method: StrictStr = ""  # cuda | bar
    pattern: StrictStr | None = None  # what was written: "0x00" (cuda), "registers" (bar)
    bytes_zeroed: Count = 0  # bytes written
    bytes_verified: Count = 0  # bytes read back
    pages_sampled: Count = 0  # read-back samples: 4 KiB pages (cuda), registers (bar)
    pages_nonzero: Count = 0  # samples that did not read back as written
    zero_ms: Finite = 0.0
    verify_ms: Finite = 0.0
    error: StrictStr | None = Field(default=None, max_length=2000)

    @property
    def readback_ok(self) -> bool:
        return self.pages_sampled > 0 and self.pages_nonzero == 0

    def evidence(self) -> dict[str, Any]:
        """The fields every scrub records, read-back verdict included."""
        d = self.model_dump(mode="json")
        return {**{k: d[k] for k in EVIDENCE_FIELDS if k in d}, "readback_ok": self.readback_ok}
