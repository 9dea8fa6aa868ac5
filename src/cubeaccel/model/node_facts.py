"""What a node can boot and attach: the guest images it holds and the hot-plug paths its VMM supports.

Cubelet reports these in every heartbeat (docs/api.md, `guest_images` and `hotplug`); CubeMaster's stage 2
check (`contract.check_node`) compares them with what a template pins. A node that reports no images can
host no template: every template pins an image, so "nothing reported" is a refusal, never a skipped check.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from cubeaccel.model.template_spec import Template

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_RELEASE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+~-]{0,127}")
_PATH = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
MAX_IMAGES = 256  # a heartbeat is bounded; a node with more images reports its newest
MAX_KERNEL_DIGESTS = 4

# QEMU: `device_add` into a `pcie-root-port` with ACPI PCI hot-plug (the shim's only attach path today)
HOTPLUG_PCIE_ROOT_PORT_ACPI = "pcie-root-port-acpi"


@dataclass(frozen=True)
class GuestImageFact:
    """One bootable guest on a node, identified as a template pins it (ARCHITECTURE §4).

    `kernel_digests` holds every digest the template's `guest.kernel.digest` may name for this image: the
    vmlinux the shim boots and the Debian vmlinuz it was extracted from (see shim/image_check.py).
    """

    digest: str
    kernel_release: str
    kernel_digests: tuple[str, ...]
    modules_img_digest: str

    def to_json(self) -> dict[str, object]:
        return {
            "digest": self.digest,
            "kernel_release": self.kernel_release,
            "kernel_digests": list(self.kernel_digests),
            "modules_img_digest": self.modules_img_digest,
        }

    @classmethod
    def from_json(cls, raw: object) -> GuestImageFact:
        """Strict: a heartbeat crosses a process boundary; a wrong value is a ValueError (a 422 upstream)."""
        if not isinstance(raw, Mapping):
            raise ValueError("guest image is not an object")
        digest, release, mods = raw.get("digest"), raw.get("kernel_release"), raw.get("modules_img_digest")
        kdigests = raw.get("kernel_digests", [])
        if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            raise ValueError(f"guest image digest must be sha256:<64 hex>, got {digest!r:.80}")
        if not isinstance(release, str) or not _RELEASE.fullmatch(release):
            raise ValueError(f"kernel_release is not a kernel release: {release!r:.80}")
        if not isinstance(mods, str) or not DIGEST.fullmatch(mods):
            raise ValueError(f"modules_img_digest must be sha256:<64 hex>, got {mods!r:.80}")
        if (
            not isinstance(kdigests, list)
            or not 0 < len(kdigests) <= MAX_KERNEL_DIGESTS
            or not all(isinstance(k, str) and DIGEST.fullmatch(k) for k in kdigests)
        ):
            raise ValueError(f"kernel_digests must be 1..{MAX_KERNEL_DIGESTS} sha256 digests")
        return cls(digest, release, tuple(kdigests), mods)


def pinned_image(t: Template) -> GuestImageFact:
    """The guest a node must hold to boot `t`: exactly what the template pins (simulated nodes, tests)."""
    return GuestImageFact(t.guest_image_digest, t.guest_kernel.version, (t.guest_kernel.digest,), t.modules_img.digest)


def parse_guest_images(raw: object) -> tuple[GuestImageFact, ...]:
    """A heartbeat's `guest_images`; absent (None) is the same as empty: the node reports nothing bootable."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_IMAGES:
        raise ValueError(f"guest_images must be a list of at most {MAX_IMAGES} objects")
    return tuple(GuestImageFact.from_json(x) for x in raw)


def parse_hotplug(raw: object) -> frozenset[str]:
    """A heartbeat's `hotplug` paths; absent is empty (the node's VMM cannot hot-plug, as far as anyone knows)."""
    if raw is None:
        return frozenset()
    if not isinstance(raw, list) or len(raw) > 16 or not all(isinstance(p, str) and _PATH.fullmatch(p) for p in raw):
        raise ValueError("hotplug must be a list of at most 16 path names ([a-z0-9-])")
    return frozenset(raw)
