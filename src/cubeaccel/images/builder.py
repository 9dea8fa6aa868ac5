"""`cubeaccel image build`: guest kernel + modules.img + rootfs from Debian packages, cached by their inputs.

The cache key hashes every input (exact package versions, the agent's and the builder's source, module set,
kernel command line), so an unchanged machine reuses the image and any change rebuilds it. Builds go to a
temporary directory and are renamed into place under a file lock: concurrent builders (parallel test workers,
two shims) never see a half-written image.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cubeaccel.images import cpio, kernel, packages, rootfs, vendor
from cubeaccel.images.flavour import VALIDATION, Flavour
from cubeaccel.images.manifest import Artifact, Manifest, sha256_file
from cubeaccel.images.nvidia import NVIDIA
from cubeaccel.images.packages import HOST_APT, Apt
from cubeaccel.images.userland import USERLAND
from cubeaccel.images.vendor import StackInputs, VendorBuild, VendorStack
from cubeaccel.protocol.errors import CubeError

STACKS: dict[str, VendorStack] = {NVIDIA.name: NVIDIA}  # `cubeaccel image build --vendor NAME`
FLAVOURS: dict[str, Flavour] = {f.name: f for f in (VALIDATION, USERLAND)}  # `--flavour NAME`
GPU_FLAVOUR = USERLAND.name  # the shipped GPU templates' flavour (docs/decisions.md): `template pin --vendor`
BUILDER_VERSION = 1
KEEP_IMAGES = 3  # older images are removed after a build (their templates go with the template pruning)
CMDLINE = "console=ttyS0 quiet loglevel=4 panic=-1 rdinit=/init 8250.nr_uarts=1 tsc=reliable no_timer_check"
_SRC_PKG = Path(__file__).resolve().parents[1]  # src/cubeaccel


def cache_dir() -> Path:
    """$CUBEACCEL_CACHE_DIR, else $XDG_CACHE_HOME/cubeaccel, else ~/.cache/cubeaccel."""
    explicit = os.environ.get("CUBEACCEL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "cubeaccel"


def _tree_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for base in paths:
        files = sorted(base.rglob("*.py")) if base.is_dir() else [base]
        for f in files:
            if "__pycache__" in f.parts:
                continue
            h.update(str(f.relative_to(_SRC_PKG)).encode() + b"\0" + f.read_bytes() + b"\0")
    return "sha256:" + h.hexdigest()


def agent_digest() -> str:
    """What goes into /opt/cubeaccel: the guest-side packages."""
    return _tree_digest([_SRC_PKG / "__init__.py", *(_SRC_PKG / sub for sub in rootfs.GUEST_SOURCE_PACKAGES)])


@dataclass(frozen=True)
class Inputs:
    kernel_package: packages.Package
    rootfs_packages: tuple[packages.Package, ...]
    agent_sha256: str
    builder_sha256: str
    stack: StackInputs | None = None  # a vendor driver stack (GPU images); None: a CPU-only image
    apt: Apt = HOST_APT
    flavour: Flavour = VALIDATION

    @property
    def key(self) -> str:
        """The image's directory name: its label (`userland-nvidia`), a dash and a digest of every input; a
        validation image without a stack has no label."""
        doc = {
            "builder": BUILDER_VERSION,
            "builder_sha256": self.builder_sha256,
            "kernel": self.kernel_package.to_json(),
            "rootfs": [p.to_json() for p in self.rootfs_packages],
            "agent": self.agent_sha256,
            "modules": list(kernel.BOOT_MODULES + kernel.EXTRA_MODULES),
            "cmdline": CMDLINE,
        }
        if self.stack is not None:
            doc["stack"] = self.stack.to_json()
        if self.flavour.prefix:
            doc["flavour"] = self.flavour.name
        digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
        return f"{self.label}-{digest}" if self.label else digest

    @property
    def label(self) -> str:
        """Flavour and stack (`userland-nvidia`, `nvidia`, `userland`, "" validation): key prefix, `latest-`
        pointer and pruning group."""
        return image_label(self.flavour, self.stack.stack if self.stack is not None else None)

    @property
    def all_packages(self) -> list[packages.Package]:
        extra = [*self.stack.rootfs] if self.stack is not None else []
        return [self.kernel_package, *self.rootfs_packages, *extra]


def image_label(flavour: Flavour = VALIDATION, stack: VendorStack | None = None) -> str:
    return "-".join(p for p in (flavour.prefix, stack.name if stack is not None else "") if p)


def _unique(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


def resolve_inputs(
    stack: VendorStack | None = None, cache: Path | None = None, flavour: Flavour = VALIDATION
) -> Inputs:
    """Exact package versions. A vendor stack's image takes everything (kernel included, so its headers match)
    from a private apt root with the stack's archive components; a CPU-only image from the host's apt."""
    apt = HOST_APT
    if stack is not None:
        apt = packages.private_apt((cache or cache_dir()) / "apt" / stack.name, stack.components)
    kpkg_name = packages.kernel_package(apt)
    pkgs = packages.resolve(_unique([kpkg_name, *rootfs.ROOTFS_PACKAGES, *flavour.packages]), apt)
    names: tuple[str, ...] = (
        "builder.py",
        "cpio.py",
        "kernel.py",
        "rootfs.py",
        "vendor.py",
        "nvidia.py",
        "packages.py",
    )
    names += ("flavour.py", "userland.py") if flavour.prefix else ()  # the validation key stays as it was
    builder_src = [_SRC_PKG / "images" / n for n in names]
    stack_inputs = vendor.resolve(stack, apt, packages.kernel_release(kpkg_name)) if stack is not None else None
    return Inputs(pkgs[0], tuple(pkgs[1:]), agent_digest(), _tree_digest(builder_src), stack_inputs, apt, flavour)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached(cache: Path, key: str) -> Manifest | None:
    path = cache / "images" / key / "manifest.json"
    if not path.exists():
        return None
    m = Manifest.load(path)
    return m if not m.verify() else None


Phase = Callable[[str], None]  # told each build phase as it begins (the CLI's live progress)


def _quiet(_: str) -> None:
    pass


def flavour_named(name: str | None) -> Flavour:
    if not name:
        return VALIDATION
    if name not in FLAVOURS:
        raise CubeError(
            "image.flavour_unknown",
            f"no image flavour {name!r}; known: {', '.join(sorted(FLAVOURS))}",
            "template",
            {"known": sorted(FLAVOURS)},
        )
    return FLAVOURS[name]


def stack_named(name: str | None) -> VendorStack | None:
    if not name:
        return None
    if name not in STACKS:
        raise CubeError(
            "image.vendor_unknown",
            f"no vendor stack {name!r}; known: {', '.join(sorted(STACKS))}",
            "template",
            {"known": sorted(STACKS)},
        )
    return STACKS[name]


def build(
    cache: Path | None = None,
    force: bool = False,
    on_phase: Phase = _quiet,
    stack: VendorStack | None = None,
    flavour: Flavour = VALIDATION,
) -> tuple[Manifest, bool]:
    """Return (manifest, built_now). Reuses a cached image whose inputs and digests match unless `force`.
    `stack`: a GPU image with that vendor's driver stack (a separate image: CPU-only ones stay lean).
    `flavour`: what the rootfs holds (validation: the agent's needs; userland: E2B's base tools)."""
    cache = cache or cache_dir()
    on_phase("resolving package versions (apt)")
    inputs = resolve_inputs(stack, cache, flavour)
    on_phase("waiting for the image cache lock")
    with _locked(cache / "images" / ".lock"):
        if not force and (m := cached(cache, inputs.key)) is not None:
            on_phase(f"verifying cached image {m.key}")
            readable_by_vmms(m.directory)  # one built under a private umask before this rule is repaired here
            _point_latest(cache, m, inputs.label)
            return m, False
        m = _build(cache, inputs, on_phase)
        readable_by_vmms(m.directory)
        _point_latest(cache, m, inputs.label)
        prune(cache / "images", keep=KEEP_IMAGES, protect=m.key, flavour=inputs.label)
        if stack is None:  # a vendor build keeps its own kernel's packages; each flavour prunes only its own
            debs = _debs_dir(cache, inputs)
            _prune_debs(debs, {packages.deb_path(debs, p).name for p in inputs.all_packages})
        return m, True


def _debs_dir(cache: Path, inputs: Inputs) -> Path:
    """Downloaded packages per apt source and flavour: a validation build's prune never drops the userland's."""
    if inputs.stack is not None:
        return cache / f"debs-{inputs.stack.stack.name}"
    return cache / (f"debs-{inputs.flavour.prefix}" if inputs.flavour.prefix else "debs")


def _flavour_of(name: str) -> str:
    """`userland-nvidia-0123…` → `userland-nvidia`; a validation image's key has no prefix."""
    return name.rsplit("-", 1)[0] if "-" in name else ""


def label_of(m: Manifest) -> str:
    """An image's label (`image_label`): "" for the validation flavour with no vendor stack, which is what a
    sandbox with no pinned image boots (the smallest guest; a userland or GPU initrd does not fit every size)."""
    return _flavour_of(m.key)


def prune(root: Path, keep: int, protect: str = "", flavour: str | None = None) -> list[str]:
    """Remove all but the `keep` most recent entries under `root` (images or template states); never `protect`,
    nor an image a running Cubelet holds (`hold_image`). `flavour`: only images of that label ("" validation),
    so a GPU or userland build never prunes another label's images."""
    entries = sorted(
        (
            p
            for p in root.iterdir()
            if p.is_dir() and not p.name.startswith("build-") and (flavour is None or _flavour_of(p.name) == flavour)
        ),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    removed = []
    for p in entries[keep:]:
        if p.name != protect and _remove_unheld(p):
            removed.append(p.name)
    return removed


def hold_image(directory: Path) -> int | None:
    """A shared lock on the image's manifest, kept as long as the returned fd is open: `prune` skips the image.
    A Cubelet holds what its sandboxes and warm pools boot, so a re-pin on the node (a new build, and its prune)
    cannot take the image of a template the node is serving. None: the image is gone or being removed."""
    try:
        fd = os.open(directory / "manifest.json", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove_unheld(entry: Path) -> bool:
    """Remove `entry` unless its manifest is held; the exclusive lock is kept while the files go, so a hold
    taken meanwhile fails instead of holding a half-removed image."""
    try:
        fd = os.open(entry / "manifest.json", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no manifest (a template state, a broken image): nothing can hold it
        shutil.rmtree(entry, ignore_errors=True)
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(entry, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def _prune_debs(debs: Path, keep: set[str]) -> None:
    """Downloaded packages of superseded versions (a new kernel point release is ~70 MB) are dropped."""
    for deb in debs.glob("*.deb"):
        if deb.name not in keep:
            deb.unlink(missing_ok=True)


def latest(cache: Path | None = None, flavour: str = "") -> Manifest | None:
    """The most recently built or reused image of a label (`image_label`: "" validation, `nvidia`, `userland`,
    `userland-nvidia`), without asking apt."""
    cache = cache or cache_dir()
    pointer = cache / "images" / _latest_name(flavour)
    if not pointer.exists():
        return None
    m = Manifest.load(cache / "images" / pointer.read_text().strip() / "manifest.json")
    return m


def cached_images(cache: Path | None = None) -> list[Manifest]:
    """Every image in the cache whose manifest loads, newest first; half-built and broken ones are skipped.

    Artifacts are not hashed here (callers that advertise or boot an image decide how much to verify).
    """
    root = (cache or cache_dir()) / "images"
    found = []
    for path in root.glob("*/manifest.json") if root.is_dir() else ():
        if path.parent.name.startswith("build-"):
            continue
        try:
            found.append((path.stat().st_mtime, Manifest.load(path)))
        except (OSError, CubeError):
            continue
    return [m for _, m in sorted(found, key=lambda x: (-x[0], x[1].key))]


def find_image(digest: str, cache: Path | None = None) -> Manifest | None:
    """The cached image whose digest is `digest` (a template's `guest.image.digest`), if any."""
    return next((m for m in cached_images(cache) if m.image_digest == digest), None)


def readable_by_vmms(directory: Path) -> None:
    """An image is read by confined VMMs that run as uids of their own: its directory 0755 and its files 0644,
    whatever the umask of the process that built it (a Cubelet or a CLI runs under a private 0077 one)."""
    directory.chmod(0o755)
    for f in directory.iterdir():
        if f.is_file() and not f.is_symlink():
            f.chmod(0o644)


def _latest_name(flavour: str) -> str:
    return f"latest-{flavour}" if flavour else "latest"


def _point_latest(cache: Path, m: Manifest, flavour: str = "") -> None:
    name = _latest_name(flavour)
    tmp = cache / "images" / f"{name}.tmp"
    tmp.write_text(m.key + "\n")
    tmp.replace(cache / "images" / name)


def _build(cache: Path, inputs: Inputs, on_phase: Phase = _quiet) -> Manifest:
    pkgs = inputs.all_packages
    on_phase(f"downloading {len(pkgs)} packages")
    debs = packages.download(_debs_dir(cache, inputs), pkgs, inputs.apt)
    n_base = 1 + len(inputs.rootfs_packages)
    final = cache / "images" / inputs.key
    work = Path(tempfile.mkdtemp(prefix=f"build-{inputs.key}-", dir=cache / "images"))
    try:
        out = work / "out"
        out.mkdir()
        ktree = work / "kernel"
        on_phase(f"kernel {inputs.kernel_package.version}: vmlinux and modules.img")
        packages.extract(debs[0], ktree)
        release = packages.kernel_release(inputs.kernel_package.name)
        vmlinuz = ktree / "boot" / f"vmlinuz-{release}"
        vmlinuz_sha = sha256_file(vmlinuz) if vmlinuz.exists() else ""
        kernel.extract_vmlinux(vmlinuz, out / "vmlinux")
        wanted: tuple[str, ...] = kernel.BOOT_MODULES + kernel.EXTRA_MODULES
        built_mods: Path | None = None
        if inputs.stack is not None:
            on_phase(f"compiling {inputs.stack.module_source.name} {inputs.stack.module_source.version} for {release}")
            built_mods = vendor.build_modules(inputs.stack, inputs.apt, cache, release)
            vendor.install_modules(built_mods, inputs.stack.stack, ktree, release)
            wanted += inputs.stack.stack.modules
        mods = kernel.build_modules_img(ktree, release, work, out / "modules.img", wanted)
        shutil.rmtree(ktree)

        root = work / "rootfs"
        on_phase("assembling the root filesystem")
        for deb in debs[1:n_base]:
            packages.extract(deb, root)
        inputs.flavour.before_prune(root)
        rootfs.prune(root, inputs.flavour.keep, inputs.flavour.keep_dynload)
        rootfs.install_busybox(root)
        rootfs.install_agent(root, _SRC_PKG)
        if inputs.flavour.prefix:
            on_phase(f"{inputs.flavour.name}: configuration, links, library check")
            inputs.flavour.install(root)
        vendor_build = None
        if inputs.stack is not None and built_mods is not None:
            on_phase(f"{inputs.stack.stack.name} user space and firmware")
            vendor_build = _install_stack(inputs.stack, debs[n_base:], root, built_mods)
        inputs.flavour.check(root)  # after the stack: it adds to the flavour, never takes a part of it away
        on_phase("compiling bytecode, smoke-testing the guest python")
        rootfs.compile_and_smoke_test(root, inputs.flavour.precompile)
        on_phase("writing rootfs.cpio and initrd.img")
        with (out / "rootfs.cpio").open("wb") as f:
            cpio.write_tree(root, f, modes=inputs.flavour.modes)
        with (out / "initrd.img").open("wb") as f:
            for part in ("rootfs.cpio", "modules.img"):
                with (out / part).open("rb") as src:
                    shutil.copyfileobj(src, f)

        def art(name: str) -> Artifact:
            return Artifact(name, sha256_file(out / name))

        m = Manifest(
            key=inputs.key,
            kernel_package=inputs.kernel_package.name,
            kernel_package_version=inputs.kernel_package.version,
            kernel_release=release,
            vmlinuz_sha256=vmlinuz_sha,
            vmlinux=art("vmlinux"),
            modules_img=art("modules.img"),
            modules=tuple(mods),
            rootfs=art("rootfs.cpio"),
            initrd=art("initrd.img"),
            packages=tuple(p.to_json() for p in inputs.rootfs_packages),
            agent_sha256=inputs.agent_sha256,
            cmdline=CMDLINE,
            directory=final,
            vendor=vendor_build,
            flavour=inputs.flavour.name,
        )
        if final.exists():
            shutil.rmtree(final)
        out.replace(final)
        m.save()
        return m
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _install_stack(stack: StackInputs, debs: list[Path], root: Path, built_mods: Path) -> VendorBuild:
    """Extract the stack's user space and firmware, make its links, check every binary's libraries resolve in
    the guest, and read the versions the manifest records from the built files."""
    recipe = stack.stack
    rootfs.extract_adding(debs, root, drop=("usr/share", "usr/lib/x86_64-linux-gnu/gbm"))
    vendor.install_rootfs(recipe, root)
    if missing := vendor.missing_libraries(root, [root / rel for rel in recipe.checked_elves]):
        raise CubeError(
            "image.vendor_file_missing",
            f"{recipe.name}: shared libraries missing from the rootfs: {missing}",
            "userspace_driver",
            {"missing": missing},
            status=500,
        )
    versions: dict[str, str] = {}
    if recipe.version_script:
        proc = rootfs.guest_python(root, "-c", recipe.version_script)
        try:
            versions = {str(k): str(v) for k, v in json.loads(proc.stdout or "{}").items()}
        except ValueError:
            versions = {}
        if proc.returncode != 0 or not versions:
            raise CubeError(
                "image.vendor_file_missing",
                f"{recipe.name}: could not read the user-space versions: {(proc.stderr or proc.stdout)[-400:]}",
                "userspace_driver",
                status=500,
            )
    return VendorBuild(
        stack=recipe.name,
        vendor=recipe.vendor,
        driver_version=recipe.driver_version,
        modules=recipe.modules,
        driver_module=recipe.driver_module,
        packages=tuple(p.to_json() for p in (*stack.headers, stack.module_source, *stack.rootfs)),
        modules_sha256=vendor.modules_sha256(built_mods, recipe),
        versions=versions,
    )
