"""Lifecycle operations a GPU sandbox does not support, refused with one clear error.

A passthrough device's state lives in hardware, outside guest RAM: a snapshot, clone, rollback or live migration
would copy a guest that believes it owns a device it no longer has (or one another tenant now has). Pause/resume
is refused too: a paused guest cannot complete a detach, which is exactly how devices get stuck.
"""

from __future__ import annotations

from cubeaccel.protocol.errors import CubeError

UNSUPPORTED = {
    "snapshot": "the device's state is in hardware, not in the snapshot",
    "clone": "1:N clones would all believe they own the same device",
    "rollback": "rolling back guest RAM does not roll back the device",
    "pause": "a paused guest cannot complete a device detach",
    "resume": "pause is not supported, so neither is resume",
    "live_migration": "the device cannot move with the VM",
}


def refuse(operation: str, sandbox_id: str, has_accelerator: bool = True) -> CubeError:
    """The error for `operation` on a GPU sandbox (raise it). Unknown operations are refused too."""
    why = UNSUPPORTED.get(operation, "not a lifecycle operation the shim knows")
    return CubeError(
        code="lifecycle.unsupported_for_accelerator" if operation in UNSUPPORTED else "lifecycle.unknown_operation",
        message=f"{operation} is not supported for sandbox {sandbox_id} with an accelerator: {why}",
        layer="backend",
        details={"operation": operation, "sandbox_id": sandbox_id, "has_accelerator": has_accelerator},
        status=409,
    )
