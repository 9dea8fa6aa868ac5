"""Host-side check of the guest image against the sandbox's frozen contract, before any VM starts.

The contract pins the guest image digest, the kernel release + digest and the modules.img digest (layers
`template`, `guest_kernel`, `modules_img`). The kernel digest may name either the Debian vmlinuz or the vmlinux the
shim boots (derived from it deterministically). cube-agent checks the running kernel again inside the guest.
"""

from __future__ import annotations

from cubeaccel.images.manifest import Manifest
from cubeaccel.model.contract import CompatibilityContract


def image_mismatches(contract: CompatibilityContract | None, manifest: Manifest) -> list[dict[str, str]]:
    """Each pinned value that differs from the manifest: {layer, code, expected, found}."""
    if contract is None:
        return []
    t, out = contract.template, []
    checks = [
        ("template", "compat.guest_image_mismatch", t.guest_image_digest, {manifest.image_digest}),
        ("guest_kernel", "compat.guest_kernel_mismatch", t.guest_kernel.version, {manifest.kernel_release}),
        (
            "guest_kernel",
            "compat.guest_kernel_digest_mismatch",
            t.guest_kernel.digest,
            {manifest.vmlinux.sha256, manifest.vmlinuz_sha256},
        ),
        ("modules_img", "compat.modules_img_kernel_mismatch", t.modules_img.kernel_version, {manifest.kernel_release}),
        ("modules_img", "compat.modules_img_mismatch", t.modules_img.digest, {manifest.modules_img.sha256}),
    ]
    for layer, code, expected, found in checks:
        if expected not in found:
            out.append({"layer": layer, "code": code, "expected": expected, "found": sorted(found)[0]})
    return out
