"""Host-side check of the guest image against the sandbox's frozen contract, before any VM starts.

The contract pins the guest image digest, the kernel release + digest and the modules.img digest (layers
`template`, `guest_kernel`, `modules_img`). The kernel digest may name either the Debian vmlinuz or the vmlinux the
shim boots (derived from it deterministically). cube-agent checks the running kernel again inside the guest.
"""

from __future__ import annotations

from typing import Any

from cubeaccel.images.manifest import Manifest
from cubeaccel.wire.shim_spec import contract_guest


def image_mismatches(contract: dict[str, Any] | None, manifest: Manifest) -> list[dict[str, str]]:
    """Each pinned value that differs from the manifest: {layer, code, expected, found}."""
    guest = contract_guest(contract or {})
    out: list[dict[str, str]] = []

    def pinned(section: str, key: str) -> str | None:
        value = guest.get(section, {}).get(key) if isinstance(guest.get(section), dict) else None
        return value if isinstance(value, str) else None

    checks = [
        ("template", "compat.guest_image_mismatch", pinned("image", "digest"), {manifest.image_digest}),
        ("guest_kernel", "compat.guest_kernel_mismatch", pinned("kernel", "version"), {manifest.kernel_release}),
        (
            "guest_kernel",
            "compat.guest_kernel_digest_mismatch",
            pinned("kernel", "digest"),
            {manifest.vmlinux.sha256, manifest.vmlinuz_sha256},
        ),
        (
            "modules_img",
            "compat.modules_img_kernel_mismatch",
            pinned("modules_img", "kernel_version"),
            {manifest.kernel_release},
        ),
        ("modules_img", "compat.modules_img_mismatch", pinned("modules_img", "digest"), {manifest.modules_img.sha256}),
    ]
    for layer, code, expected, found in checks:
        if expected is not None and expected not in found:
            out.append({"layer": layer, "code": code, "expected": expected, "found": sorted(found)[0]})
    return out
