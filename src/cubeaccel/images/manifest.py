"""The image manifest: what was built, from which packages, with which digests. Templates reference it.

`image_digest` identifies the whole guest (kernel + modules.img + rootfs); a template's contract pins it together
with the kernel release and the modules.img digest, so a rebuilt image is a different template input.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cubeaccel.images.vendor import VendorBuild
from cubeaccel.model.node_facts import GuestImageFact
from cubeaccel.protocol.errors import CubeError

FORMAT = 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


@dataclass(frozen=True)
class Artifact:
    path: str  # file name relative to the manifest's directory
    sha256: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "sha256": self.sha256}


@dataclass(frozen=True)
class Manifest:
    key: str
    kernel_package: str
    kernel_package_version: str
    kernel_release: str
    vmlinuz_sha256: str
    vmlinux: Artifact
    modules_img: Artifact
    modules: tuple[str, ...]
    rootfs: Artifact
    initrd: Artifact
    packages: tuple[dict[str, str], ...]
    agent_sha256: str
    cmdline: str
    directory: Path
    vendor: VendorBuild | None = None  # a GPU image's driver stack; None: CPU-only
    flavour: str = "validation"  # what the rootfs holds (images/flavour.py): validation, userland

    @property
    def image_digest(self) -> str:
        h = hashlib.sha256()
        for a in (self.vmlinux, self.modules_img, self.rootfs):
            h.update(a.sha256.encode() + b"\n")
        return "sha256:" + h.hexdigest()

    def fact(self) -> GuestImageFact:
        """This image as a node reports it (heartbeat `guest_images`): what a template may pin to boot it."""
        kernels = (self.vmlinux.sha256, *((self.vmlinuz_sha256,) if self.vmlinuz_sha256 else ()))
        return GuestImageFact(self.image_digest, self.kernel_release, kernels, self.modules_img.sha256)

    def path(self, artifact: Artifact) -> Path:
        return self.directory / artifact.path

    def initrd_bytes(self) -> int:
        """What a cold boot unpacks before the guest's agent can answer (0 when the file is not here)."""
        try:
            return self.path(self.initrd).stat().st_size
        except OSError:
            return 0

    def to_json(self) -> dict[str, object]:
        return {
            "format": FORMAT,
            "key": self.key,
            "image_digest": self.image_digest,
            "kernel": {
                "package": self.kernel_package,
                "package_version": self.kernel_package_version,
                "release": self.kernel_release,
                "vmlinuz_sha256": self.vmlinuz_sha256,
                "vmlinux": self.vmlinux.to_json(),
            },
            "modules_img": {
                **self.modules_img.to_json(),
                "kernel_release": self.kernel_release,
                "modules": list(self.modules),
            },
            "rootfs": {
                **self.rootfs.to_json(),
                "packages": list(self.packages),
                "agent_sha256": self.agent_sha256,
                "flavour": self.flavour,
            },
            "initrd": self.initrd.to_json(),
            "cmdline": self.cmdline,
            **({"vendor": self.vendor.to_json()} if self.vendor is not None else {}),
        }

    def save(self) -> Path:
        path = self.directory / "manifest.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: Path) -> Manifest:
        try:
            d = json.loads(path.read_text())
            if d.get("format") != FORMAT:
                raise ValueError(f"manifest format {d.get('format')!r}, expected {FORMAT}")
            k = d["kernel"]
            return cls(
                key=str(d["key"]),
                kernel_package=str(k["package"]),
                kernel_package_version=str(k["package_version"]),
                kernel_release=str(k["release"]),
                vmlinuz_sha256=str(k["vmlinuz_sha256"]),
                vmlinux=Artifact(k["vmlinux"]["path"], k["vmlinux"]["sha256"]),
                modules_img=Artifact(d["modules_img"]["path"], d["modules_img"]["sha256"]),
                modules=tuple(d["modules_img"]["modules"]),
                rootfs=Artifact(d["rootfs"]["path"], d["rootfs"]["sha256"]),
                initrd=Artifact(d["initrd"]["path"], d["initrd"]["sha256"]),
                packages=tuple(dict(p) for p in d["rootfs"]["packages"]),
                agent_sha256=str(d["rootfs"]["agent_sha256"]),
                cmdline=str(d["cmdline"]),
                directory=path.parent,
                vendor=VendorBuild.from_json(d["vendor"]) if isinstance(d.get("vendor"), dict) else None,
                flavour=str(d["rootfs"].get("flavour", "validation")),
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CubeError("image.manifest_invalid", f"{path}: {e}", layer="template", status=422) from e

    def verify(self) -> list[str]:
        """Artifacts whose file is missing or whose digest no longer matches (empty: intact)."""
        bad = []
        for a in (self.vmlinux, self.modules_img, self.rootfs, self.initrd):
            p = self.path(a)
            if not p.exists() or sha256_file(p) != a.sha256:
                bad.append(a.path)
        return bad


GUEST_PINS = (
    ("spec", "guest", "image", "digest"),
    ("spec", "guest", "kernel", "version"),
    ("spec", "guest", "kernel", "digest"),
    ("spec", "guest", "modules_img", "kernel_version"),
    ("spec", "guest", "modules_img", "digest"),
)
VENDOR_PINS = (
    ("spec", "driver", "kernel", "version"),
    ("spec", "driver", "userspace", "version"),
    ("spec", "cuda", "version"),
)


def pinned_paths(document: dict[str, Any], image: Manifest) -> tuple[tuple[str, ...], ...]:
    """The key paths `pin_template_document` writes for this document and image."""
    spec = document.get("spec") or {}
    if image.vendor is None or "driver" not in spec:
        return GUEST_PINS
    return GUEST_PINS + tuple(p for p in VENDOR_PINS if p[1] != "cuda" or "cuda" in spec)


def pin_template_document(document: dict[str, Any], image: Manifest) -> dict[str, Any]:
    """A template document whose guest image, kernel and modules.img are the ones this host built, and, for a
    GPU image, whose driver (kernel module and user space) and CUDA driver API versions are the image's own.

    Debian moves its kernel point release often; the demo and `cubeaccel up` register the emulated
    template against the image actually in the cache, so its contract is true on this machine.
    """
    doc = copy.deepcopy(document)
    guest = doc["spec"]["guest"]
    guest["image"]["digest"] = image.image_digest
    guest["kernel"] = {"version": image.kernel_release, "digest": image.vmlinux.sha256}
    guest["modules_img"] = {"kernel_version": image.kernel_release, "digest": image.modules_img.sha256}
    spec = doc["spec"]
    if image.vendor is not None and isinstance(spec.get("driver"), dict):
        spec["driver"]["kernel"]["version"] = image.vendor.driver_version
        spec["driver"]["userspace"]["version"] = image.vendor.driver_version
        api = image.vendor.versions.get("cuda_driver_api")
        if api and isinstance(spec.get("cuda"), dict):
            spec["cuda"]["version"] = api
    return doc
