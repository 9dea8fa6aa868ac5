"""`cubeaccel image import`: take a guest built elsewhere into this node's image cache, checked first.

An operator may build a GPU guest on another machine (a newer driver, a vendor's own packages). The import takes a
directory laid out as this builder writes one (manifest.json beside its artifacts), proves every artifact has the
digest its manifest names, and proves the manifest is what the template pins: guest image, kernel, modules.img, and
for a vendor image its driver and CUDA driver API versions. Only then is it copied into the cache, where Cubelet
advertises it like an image it built. Each refusal names the layer whose artifact disagrees.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from cubeaccel.images.manifest import Manifest, pin_template_document, pinned_paths
from cubeaccel.protocol.errors import CubeError

_LAYER_OF = {"image": "template", "kernel": "guest_kernel", "modules_img": "modules_img", "driver": "kernel_driver"}


def _get(doc: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        doc = doc.get(k) if isinstance(doc, dict) else None
    return doc


def mismatches(template: dict[str, Any], image: Manifest) -> list[dict[str, str]]:
    """What the template pins that the image is not: [{field, template, image, layer}]."""
    want = pin_template_document(template, image)
    out = []
    for path in pinned_paths(template, image):
        have, pinned = str(_get(want, path)), str(_get(template, path))
        if have != pinned:
            layer = "cuda_runtime" if path[1] == "cuda" else _LAYER_OF.get(path[2] if path[1] == "guest" else path[1])
            if path[:3] == ("spec", "driver", "userspace"):
                layer = "userspace_driver"
            out.append({"field": ".".join(path), "template": pinned, "image": have, "layer": layer or "template"})
    return out


def import_image(source: Path, template: dict[str, Any], cache: Path) -> Manifest:
    """Check `source` (manifest.json + artifacts) against itself and `template`, then copy it into the cache."""
    m = Manifest.load(source / "manifest.json")
    if bad := m.verify():
        raise CubeError(
            "image.import_mismatch",
            f"{source}: artifacts do not match their manifest: {', '.join(bad)}",
            "template",
            {"corrupt": bad},
        )
    if diff := mismatches(template, m):
        first = diff[0]
        raise CubeError(
            "image.import_mismatch",
            f"the image is not what the template pins: {first['field']} is {first['image']}, "
            f"the template says {first['template']}" + (f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""),
            first["layer"],
            {"mismatches": diff},
        )
    dest = cache / "images" / f"import-{m.image_digest.removeprefix('sha256:')[:16]}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="build-import-", dir=dest.parent))
    try:
        for name in {a.path for a in (m.vmlinux, m.modules_img, m.rootfs, m.initrd)} | {"manifest.json"}:
            shutil.copy2(source / name, staging / name)
        shutil.rmtree(dest, ignore_errors=True)
        staging.replace(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    imported = Manifest.load(dest / "manifest.json")
    if imported.verify():  # copied bytes are checked again where they will be booted from
        raise CubeError("image.import_mismatch", f"{dest}: the copy does not match the manifest", "template")
    return imported
