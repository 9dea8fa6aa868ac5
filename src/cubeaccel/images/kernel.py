"""Guest kernel artifacts: an ELF vmlinux for PVH boot, and modules.img for exactly that kernel.

Debian ships an XZ-compressed bzImage. Under TCG the in-guest decompressor costs ~2.4 s per boot, so it is
decompressed once here (from the XZ magic) into the ELF vmlinux QEMU boots directly via its PVH note.
modules.img is a cpio archive of `lib/modules/<release>/` holding a chosen module set and their dependencies,
with `modules.dep` written here (no depmod needed); every module's vermagic is checked against the release.
"""

from __future__ import annotations

import lzma
import shutil
from pathlib import Path

from cubeaccel.images.cpio import write_tree
from cubeaccel.images.packages import image_error

XZ_MAGIC = b"\xfd7zXZ\x00"
ELF_MAGIC = b"\x7fELF"

# The agent channel (virtio-serial) needs the virtio stack, which Debian builds as modules; uio_pci_generic is a
# generic in-guest driver the emulated accelerator can bind to (the contract's `kernel_driver` probe for `edu`).
BOOT_MODULES = ("virtio_pci", "virtio_console")
# The home's RAM disk and its filesystem (ext4 asks the crypto API for crc32c: a soft dependency, loaded first), and
# the sandbox policy's devices, loaded only when the command line asks (images/rootfs.py): a NIC, the scratch disk,
# read-only 9p shares.
EXTRA_MODULES = (
    "uio_pci_generic",
    "pci-stub",
    "brd",
    "virtio_net",
    "virtio_blk",
    "crc32c_generic",
    "ext4",
    "9pnet_virtio",
    "9p",
)


def extract_vmlinux(bzimage: Path, dest: Path) -> None:
    """Find the XZ stream inside the bzImage and decompress it to the ELF vmlinux."""
    blob = bzimage.read_bytes()
    start = blob.find(XZ_MAGIC)
    if start < 0:
        raise image_error("image.kernel_format", f"{bzimage.name}: no XZ payload (not an XZ bzImage)")
    dec = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    try:
        elf = dec.decompress(blob[start:])
    except lzma.LZMAError as e:
        raise image_error("image.kernel_format", f"{bzimage.name}: XZ payload is corrupt: {e}") from e
    if not elf.startswith(ELF_MAGIC):
        raise image_error("image.kernel_format", f"{bzimage.name}: payload is not an ELF vmlinux")
    dest.write_bytes(elf)


def modinfo(ko: Path) -> dict[str, str]:
    """`key=value` strings of a module's .modinfo section (NUL-separated; first occurrence wins)."""
    info: dict[str, str] = {}
    data = ko.read_bytes()
    for key in (b"depends=", b"vermagic=", b"name="):
        i = data.find(b"\0" + key)
        if i >= 0:
            end = data.index(b"\0", i + 1)
            info[key[:-1].decode()] = data[i + 1 + len(key) : end].decode(errors="replace")
    return info


def _index(moddir: Path) -> dict[str, Path]:
    """Module name (dashes as underscores) → .ko path."""
    return {p.name[:-3].replace("-", "_"): p for p in moddir.rglob("*.ko")}


def module_closure(moddir: Path, release: str, wanted: tuple[str, ...]) -> dict[str, list[str]]:
    """Each wanted module plus its dependencies → its direct dependencies. Checks vermagic per module."""
    index = _index(moddir)
    deps: dict[str, list[str]] = {}
    todo = [w.replace("-", "_") for w in wanted]
    while todo:
        name = todo.pop()
        if name in deps:
            continue
        ko = index.get(name)
        if ko is None:
            raise image_error("image.module_missing", f"kernel {release} has no module {name}", layer="modules_img")
        info = modinfo(ko)
        if not info.get("vermagic", "").startswith(release + " "):
            raise image_error(
                "image.module_vermagic",
                f"{name} is built for {info.get('vermagic')!r}, not {release}",
                layer="modules_img",
            )
        direct = [d.replace("-", "_") for d in info.get("depends", "").split(",") if d]
        deps[name] = direct
        todo.extend(direct)
    return deps


def build_modules_img(
    kernel_tree: Path, release: str, work: Path, dest: Path, wanted: tuple[str, ...] = BOOT_MODULES + EXTRA_MODULES
) -> list[str]:
    """Write modules.img (cpio of lib/modules/<release>) for `wanted` and their dependencies; returns names."""
    moddir = kernel_tree / "lib" / "modules" / release
    if not moddir.is_dir():
        raise image_error("image.kernel_format", f"kernel package has no lib/modules/{release}")
    deps = module_closure(moddir, release, wanted)
    index = _index(moddir)
    out_root = work / "modules"
    if out_root.exists():
        shutil.rmtree(out_root)
    out_root.mkdir(parents=True)
    lines = []
    for name in sorted(deps):
        rel = index[name].relative_to(moddir)
        (out_root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(index[name], out_root / rel)
        dep_paths = " ".join(str(index[d].relative_to(moddir)) for d in _ordered_deps(name, deps))
        lines.append(f"{rel}: {dep_paths}".rstrip())
    (out_root / "modules.dep").write_text("\n".join(lines) + "\n")
    for extra in ("modules.builtin", "modules.order"):
        if (moddir / extra).exists():
            shutil.copyfile(moddir / extra, out_root / extra)
    with dest.open("wb") as f:
        write_tree(out_root, f, prefix=f"lib/modules/{release}")
    return sorted(deps)


def _ordered_deps(name: str, deps: dict[str, list[str]]) -> list[str]:
    """All transitive dependencies in modules.dep order: every module before the ones it needs.

    modprobe loads the list from the end, so the end must be the module nothing else needs. A breadth-first
    order is not enough: in Debian 6.1.0-57 `virtio` itself needs `virtio_ring`.
    """
    post: list[str] = []

    def visit(mod: str, stack: tuple[str, ...]) -> None:
        for d in deps.get(mod, []):
            if d not in post and d not in stack:
                visit(d, (*stack, d))
        if mod not in post:
            post.append(mod)

    visit(name, (name,))
    post.remove(name)
    return list(reversed(post))
