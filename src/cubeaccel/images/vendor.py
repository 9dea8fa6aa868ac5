"""Vendor driver stacks for GPU guest images: kernel modules compiled for the guest kernel, firmware, user space.

A stack is a recipe (`VendorStack`, one per vendor module such as images/nvidia.py): which Debian packages, at
which pinned driver version, which DKMS source to compile, which modules ship, which files get which links. This
module runs any recipe: it compiles the DKMS source against the guest kernel's own headers (extracted from the
archive, never the host's), strips the modules reproducibly and lays user space and firmware into the rootfs.
CPU-only images use no stack and stay as lean as before.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cubeaccel.images import kernel, packages
from cubeaccel.images.packages import Apt, Package, image_error

HEADERS_META = "linux-headers-{release}"
MODULE_DIR = "updates/dkms"  # where DKMS puts out-of-tree modules, inside lib/modules/<release>
BUILD_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class VendorStack:
    """One vendor's guest stack. `driver_version` is the upstream version every versioned package must carry
    (kernel module and user space must be the same build, or the driver refuses with an API mismatch)."""

    name: str  # the CLI's --vendor value and the manifest's stack name: nvidia
    vendor: str  # the device labels' vendor
    driver_version: str
    components: tuple[str, ...]  # archive components the private apt root enables
    module_source_package: str  # the DKMS source package
    module_source_glob: str  # its tree under the extracted package
    make_args: tuple[str, ...]  # extra make arguments (which modules to build)
    modules: tuple[str, ...]  # built modules shipped in modules.img (names as /proc/modules writes them)
    driver_module: str  # the module that binds the device: its load failure is layer kernel_driver
    versioned_packages: tuple[str, ...]  # user space and firmware at exactly driver_version
    other_packages: tuple[str, ...]  # helpers versioned on their own (nvidia-modprobe, persistenced, their libs)
    links: tuple[tuple[str, str], ...]  # (link in the rootfs, target glob relative to the rootfs) after extraction
    drop: tuple[str, ...] = ()  # files of the packages the guest never uses (X, Vulkan, docs)
    checked_elves: tuple[str, ...] = ()  # binaries and libraries whose shared libraries must all be in the rootfs
    # Guest python code run against the built rootfs that prints a JSON object of versions for the manifest.
    version_script: str = ""


@dataclass(frozen=True)
class VendorBuild:
    """What the stack contributed to one image, recorded in its manifest."""

    stack: str
    vendor: str
    driver_version: str
    modules: tuple[str, ...]
    driver_module: str
    packages: tuple[dict[str, str], ...]
    modules_sha256: dict[str, str]
    versions: dict[str, str]  # e.g. cuda_driver_api: 12.2 (read from the built image, not assumed)

    def to_json(self) -> dict[str, object]:
        return {
            "stack": self.stack,
            "vendor": self.vendor,
            "driver_version": self.driver_version,
            "driver_module": self.driver_module,
            "modules": list(self.modules),
            "modules_sha256": dict(sorted(self.modules_sha256.items())),
            "packages": list(self.packages),
            "versions": dict(sorted(self.versions.items())),
        }

    @classmethod
    def from_json(cls, d: dict[str, object]) -> VendorBuild:
        def strs(v: object) -> tuple[str, ...]:
            return tuple(str(x) for x in v) if isinstance(v, list) else ()

        def mapping(v: object) -> dict[str, str]:
            return {str(k): str(x) for k, x in v.items()} if isinstance(v, dict) else {}

        pkgs = d.get("packages")
        return cls(
            stack=str(d["stack"]),
            vendor=str(d["vendor"]),
            driver_version=str(d["driver_version"]),
            modules=strs(d.get("modules")),
            driver_module=str(d.get("driver_module", "")),
            packages=tuple(mapping(p) for p in pkgs) if isinstance(pkgs, list) else (),
            modules_sha256=mapping(d.get("modules_sha256")),
            versions=mapping(d.get("versions")),
        )


@dataclass(frozen=True)
class StackInputs:
    """The exact packages one build of a stack uses: part of the image's cache key."""

    stack: VendorStack
    headers: tuple[Package, ...]
    module_source: Package
    rootfs: tuple[Package, ...]

    def to_json(self) -> dict[str, object]:
        return {
            "stack": self.stack.name,
            "driver_version": self.stack.driver_version,
            "make_args": list(self.stack.make_args),
            "modules": list(self.stack.modules),
            "headers": [p.to_json() for p in self.headers],
            "module_source": self.module_source.to_json(),
            "rootfs": [p.to_json() for p in self.rootfs],
        }

    @property
    def modules_key(self) -> str:
        """The compiled modules depend only on the headers, the source and how it is built (and the compiler)."""
        doc = repr((self.headers, self.module_source, self.stack.make_args, self.stack.modules, _compiler()))
        return hashlib.sha256(doc.encode()).hexdigest()[:16]


def _compiler() -> str:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise image_error("image.tool_missing", "gcc not found (apt-get install gcc)", layer="modules_img")
    return subprocess.run([gcc, "--version"], capture_output=True, text=True, check=False).stdout.splitlines()[0]


def resolve(stack: VendorStack, apt: Apt, release: str) -> StackInputs:
    """Exact versions: the kernel's headers at the kernel's own version, the stack's packages at its driver."""
    hdr = HEADERS_META.format(release=release)
    deps = packages.depends(apt, hdr)
    header_names = [hdr, *(d for d in deps if d.startswith(("linux-headers-", "linux-kbuild-")))]
    headers = packages.resolve(header_names, apt)
    pinned = {n: stack.driver_version for n in (stack.module_source_package, *stack.versioned_packages)}
    versioned = packages.resolve([stack.module_source_package, *stack.versioned_packages], apt, pinned)
    others = packages.resolve(list(stack.other_packages), apt) if stack.other_packages else []
    return StackInputs(stack, tuple(headers), versioned[0], tuple(versioned[1:]) + tuple(others))


def build_modules(inputs: StackInputs, apt: Apt, cache: Path, release: str) -> Path:
    """Compile the stack's modules for `release` (cached by `modules_key`); returns the directory of .ko files.

    The build runs in a fixed directory under the cache with `-ffile-prefix-map`, and debug info is stripped, so
    the same inputs give the same bytes wherever the cache lives (the image's digest depends on them)."""
    out = cache / "vendor-modules" / inputs.modules_key
    if all((out / f"{m}.ko").exists() for m in inputs.stack.modules):
        return out
    debs = packages.download(cache / f"debs-{inputs.stack.name}", [*inputs.headers, inputs.module_source], apt)
    work = cache / "vendor-build" / inputs.modules_key
    shutil.rmtree(work, ignore_errors=True)
    tree = work / "tree"
    for deb in debs:
        packages.extract(deb, tree)
    sources = sorted(tree.glob(inputs.stack.module_source_glob))
    hdr_common = sorted(tree.glob("usr/src/linux-headers-*-common"))
    hdr_arch = tree / "usr" / "src" / f"linux-headers-{release}"
    if len(sources) != 1 or len(hdr_common) != 1 or not hdr_arch.is_dir():
        raise image_error(
            "image.vendor_build_failed",
            f"{inputs.module_source.name}: expected one source tree and {release} headers, found "
            f"{[str(s.relative_to(tree)) for s in sources]}",
            layer="modules_img",
        )
    src = sources[0]
    prefix_maps = f"-ffile-prefix-map={src}=/usr/src/vendor -ffile-prefix-map={tree}=/"
    env = {
        "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(work),
        "LC_ALL": "C",
        "SOURCE_DATE_EPOCH": "0",
        "KBUILD_BUILD_TIMESTAMP": "1970-01-01",
        "KBUILD_BUILD_USER": "cubeaccel",
        "KBUILD_BUILD_HOST": "cubeaccel",
    }
    args = [
        "make",
        f"-j{max(1, os.cpu_count() or 1)}",
        "modules",
        f"KERNEL_UNAME={release}",
        f"SYSSRC={hdr_common[0]}",
        f"SYSOUT={hdr_arch}",
        f"KCFLAGS={prefix_maps}",
        *inputs.stack.make_args,
    ]
    log = work / "build.log"
    with log.open("wb") as f:
        try:
            proc = subprocess.run(args, cwd=src, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise image_error(
                "image.vendor_build_failed", f"module build ran past {BUILD_TIMEOUT_S:g}s", layer="modules_img"
            ) from e
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-1500:]
        raise image_error(
            "image.vendor_build_failed",
            f"make modules for {release} failed (exit {proc.returncode}): {tail}",
            layer="modules_img",
            log=str(log),
        )
    staged = work / "out"
    staged.mkdir()
    for name in inputs.stack.modules:
        built = sorted(src.rglob(f"{name.replace('_', '-')}.ko")) or sorted(src.rglob(f"{name}.ko"))
        if not built:
            raise image_error("image.module_missing", f"the build produced no {name}.ko", layer="modules_img")
        dest = staged / f"{name}.ko"
        subprocess.run(["strip", "--strip-debug", "-o", str(dest), str(built[0])], check=True)
        vermagic = kernel.modinfo(dest).get("vermagic", "")
        if not vermagic.startswith(release + " "):
            raise image_error(
                "image.module_vermagic", f"{name} is built for {vermagic!r}, not {release}", layer="modules_img"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    staged.replace(out)
    shutil.rmtree(work, ignore_errors=True)
    return out


def install_modules(built: Path, stack: VendorStack, kernel_tree: Path, release: str) -> None:
    """Place the compiled modules where DKMS would, so the modules.img closure finds them beside the kernel's."""
    dest = kernel_tree / "lib" / "modules" / release / MODULE_DIR
    dest.mkdir(parents=True, exist_ok=True)
    for name in stack.modules:
        shutil.copyfile(built / f"{name}.ko", dest / f"{name.replace('_', '-')}.ko")


def install_rootfs(stack: VendorStack, root: Path) -> None:
    """Links the Debian packages leave to update-alternatives (which never runs here), then the drops."""
    for link, target_glob in stack.links:
        targets = sorted(root.glob(target_glob))
        if len(targets) != 1:
            raise image_error(
                "image.vendor_file_missing",
                f"{stack.name}: {target_glob} matched {len(targets)} files in the rootfs",
                layer="userspace_driver",
            )
        path = root / link.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.exists():
            path.unlink()
        path.symlink_to(os.path.relpath(targets[0], path.parent))
    for rel in stack.drop:
        for p in root.glob(rel):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)


_ELF_NEEDED_MISSING = re.compile(r"^\s*(\S+) => not found", re.M)


def missing_libraries(root: Path, elf_files: list[Path]) -> dict[str, list[str]]:
    """Each ELF file's shared libraries that the rootfs cannot provide (the guest's loader in --list mode)."""
    ld = root / "lib64" / "ld-linux-x86-64.so.2"
    libs = f"{root}/lib/x86_64-linux-gnu:{root}/usr/lib/x86_64-linux-gnu"
    missing: dict[str, list[str]] = {}
    for f in elf_files:
        proc = subprocess.run(
            [str(ld), "--library-path", libs, "--list", str(f)], capture_output=True, text=True, check=False
        )
        if names := _ELF_NEEDED_MISSING.findall(proc.stdout):
            missing[str(f.relative_to(root))] = names
    return missing


def modules_sha256(built: Path, stack: VendorStack) -> dict[str, str]:
    return {name: "sha256:" + hashlib.sha256((built / f"{name}.ko").read_bytes()).hexdigest() for name in stack.modules}
