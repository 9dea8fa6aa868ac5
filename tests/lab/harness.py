"""The VFIO lab: a TCG guest with QEMU's emulated VT-d, where cubeaccel's real VfioBackend + SysfsPciHost drive the
real Linux VFIO stack (vfio, vfio_iommu_type1, vfio-pci from the Debian kernel package the guest image uses).

The initrd is the cached guest image's rootfs (busybox + python3.11) followed by two more cpio archives, which the
kernel unpacks over it: the VFIO module closure (cached per kernel package) and an overlay with the lab's init,
the scenario scripts and cubeaccel's stdlib-only layers (model, host, backends) precompiled for the guest's 3.11.
With `with_qemu` a QEMU (binary, libraries, TCG module, firmware; cached) is added so a VMM can hold the device,
and the Cubelet's closure (cubelet, shim, agent, images; qemu.qmp; sqlite3) so the Cubelet itself runs there.

One boot runs many scenarios (`tests/lab/guest/scenarios.py`); results are JSON lines on the serial console. A
boot that never reaches the runner is retried once; everything has a deadline. Measured facts and pitfalls:
docs/vfio.md, "The lab's measured facts".
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import json
import os
import py_compile
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cubeaccel.images import cpio, kernel, packages
from cubeaccel.images.builder import build, cache_dir, resolve_inputs
from cubeaccel.protocol.agent_protocol import MAX_DEADLINE_SCALE, deadline_scale

SRC_PKG = Path(__file__).resolve().parents[2] / "src" / "cubeaccel"
GUEST_DIR = Path(__file__).resolve().parent / "guest"
LAB_MODULES = ("vfio", "vfio_iommu_type1", "vfio_pci", "uio_pci_generic", "pci_stub")
# Members of the kernel package that hold LAB_MODULES and their closure (vfio_pci_core, vfio_virqfd, irqbypass).
_MODULE_GLOBS = (
    "*/kernel/drivers/vfio/*",
    "*/kernel/virt/lib/*",
    "*/kernel/drivers/uio/*",
    "*/kernel/drivers/pci/pci-stub.ko",
    "*/modules.builtin",
    "*/modules.order",
)
# cubeaccel's parts the backend scenarios import: stdlib only.
GUEST_PACKAGES = ("protocol", "model", "host", "backends")
# With a VMM, the Cubelet runs in the guest too: its closure (the wire models need pydantic), qemu.qmp, sqlite3.
CUBELET_PACKAGES = ("cubelet", "shim", "agent", "images", "wire", "transport")
# Third-party distributions the Cubelet's closure imports, copied from this interpreter's site-packages (pure
# Python but pydantic_core, a cp311 manylinux extension that loads on the guest's Debian 3.11).
CUBELET_THIRD_PARTY = (
    "pydantic",
    "pydantic_core",
    "annotated_types",
    "typing_extensions",
    "typing_inspection",
    "prometheus_client",  # the Cubelet's metrics (transport/telemetry.py, cubelet/metrics.py)
)
_SQLITE_GLOBS = ("./usr/lib/python3.11/sqlite3/*", "./usr/lib/python3.11/lib-dynload/_sqlite3*")
LIBSQLITE = "/usr/lib/x86_64-linux-gnu/libsqlite3.so.0"
LIBGCC = "/usr/lib/x86_64-linux-gnu/libgcc_s.so.1"  # pydantic_core's one library beyond glibc
QEMU = "qemu-system-x86_64"
QEMU_FIRMWARE = (
    "/usr/share/seabios/bios-256k.bin",
    "/usr/share/qemu/kvmvapic.bin",
    "/usr/share/qemu/linuxboot_dma.bin",
    "/usr/share/qemu/linuxboot.bin",
    "/usr/share/qemu/pvh.bin",
    "/usr/share/qemu/multiboot_dma.bin",
)
QEMU_MODULES = ("/usr/lib/x86_64-linux-gnu/qemu/accel-tcg-x86_64.so",)

# edu on the root complex (no reset method), edu behind a pcie-root-port (bus reset), a multifunction pair (one
# group). Fixed addresses: the scenarios name them (guest/scenarios.py).
LAB_DEVICES = (
    "-device", "edu,id=edu0,addr=03.0",
    "-device", "pcie-root-port,id=rp1,chassis=1,slot=1,addr=04.0",
    "-device", "edu,id=edu1,bus=rp1",
    "-device", "edu,id=mf0,addr=05.0,multifunction=on",
    "-device", "edu,id=mf1,addr=05.1",
)  # fmt: skip
# Read once at import: tests/vm points CUBEACCEL_CACHE_DIR at a per-run cache (no .debs there) for its session.
SHARED_CACHE = cache_dir()
CMDLINE = "console=ttyS0 loglevel=1 panic=-1 rdinit=/init 8250.nr_uarts=1 tsc=reliable no_timer_check"


class LabError(AssertionError):
    """The lab could not produce results (boot, build or runner failure): a test failure, never a skip."""


@dataclass(frozen=True)
class LabImage:
    vmlinux: Path
    initrd: Path
    kernel_release: str
    build_s: float
    initrd_bytes: int


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:16]


def _cached(path: Path, make: Any) -> Path:
    """`make(tmp)` once per cache key (the file name); atomic rename, so concurrent runs share it safely. A new
    key removes the files of older keys of the same kind (the QEMU bundle is ~50 MB)."""
    if path.exists():
        return path
    with _locked(path.parent / ".lock"):
        if not path.exists():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            make(tmp)
            tmp.replace(path)
            kind = path.name.split("-", 1)[0]
            for old in path.parent.glob(f"{kind}-*.cpio"):
                if old != path:
                    old.unlink(missing_ok=True)  # a run using it holds its own concatenated initrd
    return path


def _modules_cpio(deb: Path, release: str, dest: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="lab-mods-") as tmp:
        work = Path(tmp)
        dpkg = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
        tar = subprocess.run(
            ["tar", "-x", "-C", str(work), "--wildcards", *_MODULE_GLOBS], stdin=dpkg.stdout, capture_output=True
        )
        dpkg.wait()
        if dpkg.returncode != 0 or tar.returncode != 0:
            raise LabError(f"extracting modules from {deb.name} failed: {tar.stderr.decode()[-500:]}")
        moddir = work / "lib" / "modules" / release
        deps = kernel.module_closure(moddir, release, LAB_MODULES)
        index = {p.name[:-3].replace("-", "_"): p for p in moddir.rglob("*.ko")}
        out = work / "out"
        lines = []
        for name in sorted(deps):
            rel = index[name].relative_to(moddir)
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(index[name], out / rel)
            order = kernel._ordered_deps(name, deps)
            lines.append(f"{rel}: {' '.join(str(index[d].relative_to(moddir)) for d in order)}".rstrip())
        (out / "modules.dep").write_text("\n".join(lines) + "\n")
        for extra in ("modules.builtin", "modules.order"):
            if (moddir / extra).exists():
                shutil.copyfile(moddir / extra, out / extra)
        with dest.open("wb") as f:
            cpio.write_tree(out, f, prefix=f"lib/modules/{release}")


def _ldd(binary: Path) -> list[Path]:
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    return [Path(p) for line in out.splitlines() for p in line.split() if p.startswith("/")]


def _qemu_cpio(dest: Path) -> None:
    """QEMU for the lab guest: it runs there with LD_LIBRARY_PATH, QEMU_MODULE_DIR and -L (see the note)."""
    binary = shutil.which(QEMU)
    assert binary is not None
    with tempfile.TemporaryDirectory(prefix="lab-qemu-") as tmp:
        root = Path(tmp) / "root"
        for d in ("bin", "lib", "modules", "share"):
            (root / d).mkdir(parents=True)
        shutil.copy2(binary, root / "bin" / QEMU)
        libs = set(_ldd(Path(binary)))
        for mod in QEMU_MODULES:
            shutil.copy2(mod, root / "modules" / Path(mod).name)
            libs |= set(_ldd(Path(mod)))
        for lib in libs:
            shutil.copyfile(lib.resolve(), root / "lib" / lib.name)
        for fw in QEMU_FIRMWARE:
            shutil.copyfile(Path(fw).resolve(), root / "share" / Path(fw).name)
        with dest.open("wb") as f:
            cpio.write_tree(root, f, prefix="opt/qemu")


def _compile_into(src: Path, dst: Path, guest_dir: str) -> None:
    """Copy a .py and, when this interpreter is the guest's 3.11, its unchecked-hash pyc (no compile per boot)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    if sys.version_info[:2] == (3, 11):
        pyc = dst.parent / "__pycache__" / f"{dst.stem}.cpython-311.pyc"
        py_compile.compile(
            str(src),
            cfile=str(pyc),
            dfile=f"{guest_dir}/{dst.name}",
            doraise=True,
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )


def _qmp_package() -> Path:
    import qemu.qmp  # the shim's QMP client (pure Python): from this interpreter's site-packages

    return Path(qemu.qmp.__file__).parent


def _third_party(root: Path) -> None:
    """CUBELET_THIRD_PARTY into /opt/cubeaccel: .py compiled like cubeaccel's own, everything else copied."""
    import importlib.util

    for name in CUBELET_THIRD_PARTY:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise LabError(f"{name} is not installed in this interpreter (the Cubelet's closure needs it)")
        origin = Path(spec.origin)
        top = origin.parent if spec.submodule_search_locations else origin
        files = sorted(top.rglob("*")) if top.is_dir() else [top]
        base = top.parent
        for f in files:
            if not f.is_file() or "__pycache__" in f.parts:
                continue
            rel = f.relative_to(base)
            dst = root / "opt" / "cubeaccel" / rel
            if f.suffix == ".py":
                _compile_into(f, dst, f"/opt/cubeaccel/{rel.parent}")
            else:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, dst)
    lib = root / LIBGCC.lstrip("/")
    lib.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(LIBGCC).resolve(), lib)


def _sqlite(stdlib_deb: Path, root: Path) -> None:
    """sqlite3 as the guest image prunes it: the module and extension from the same Debian package, the library
    from this (Debian) host."""
    dpkg = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(stdlib_deb)], stdout=subprocess.PIPE)
    tar = subprocess.run(["tar", "-x", "-C", str(root), "--wildcards", *_SQLITE_GLOBS], stdin=dpkg.stdout)
    dpkg.wait()
    if dpkg.returncode != 0 or tar.returncode != 0:
        raise LabError(f"extracting sqlite3 from {stdlib_deb.name} failed")
    lib = root / LIBSQLITE.lstrip("/")
    lib.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(LIBSQLITE).resolve(), lib)


def _overlay_cpio(dest: Path, cubelet_from: Path | None, extra: dict[str, Path] | None = None) -> None:
    """The lab's init and scenarios, cubeaccel's guest-side packages; with `cubelet_from` (the python stdlib .deb)
    also the Cubelet's closure."""
    with tempfile.TemporaryDirectory(prefix="lab-overlay-") as tmp:
        root = Path(tmp)
        pkg = root / "opt" / "cubeaccel" / "cubeaccel"
        _compile_into(SRC_PKG / "__init__.py", pkg / "__init__.py", "/opt/cubeaccel/cubeaccel")
        subs = GUEST_PACKAGES + (CUBELET_PACKAGES if cubelet_from else ())
        for sub in subs:
            for f in sorted((SRC_PKG / sub).rglob("*.py")):  # with subpackages (host/pci, host/vmm, ...)
                rel = f.relative_to(SRC_PKG)
                _compile_into(f, pkg / rel, f"/opt/cubeaccel/cubeaccel/{rel.parent}")
        if cubelet_from is not None:
            qmp = _qmp_package()
            for f in sorted(qmp.glob("*.py")):
                _compile_into(f, root / "opt" / "cubeaccel" / "qemu" / "qmp" / f.name, "/opt/cubeaccel/qemu/qmp")
            _third_party(root)
            _sqlite(cubelet_from, root)
        for f in sorted(GUEST_DIR.glob("*.py")):
            _compile_into(f, root / "lab" / f.name, "/lab")
        for guest_path, src in (extra or {}).items():
            (root / guest_path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / guest_path.lstrip("/"))
        shutil.copy2(GUEST_DIR / "init", root / "init")
        (root / "init").chmod(0o755)
        with dest.open("wb") as archive:
            cpio.write_tree(root, archive)


@dataclass(frozen=True)
class LabParts:
    """What every lab image shares: the guest image's kernel and rootfs (this run's links), the VFIO modules."""

    vmlinux: Path
    rootfs: Path
    modules: Path
    stdlib_deb: Path
    kernel_release: str


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)  # cached images are immutable once in place: a hard link is a private copy
    except OSError:
        shutil.copyfile(src, dst)


def lab_parts(work: Path) -> LabParts:
    """Build (or reuse) the guest image and the VFIO module closure; take this run's own links into `work`."""
    cache = SHARED_CACHE
    manifest, _built = build(cache)
    inputs = resolve_inputs()
    release = packages.kernel_release(inputs.kernel_package.name)
    lab_cache = cache / "lab"
    lab_cache.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    stdlib = next(p for p in inputs.rootfs_packages if p.name == "libpython3.11-stdlib")
    with _locked(cache / "images" / ".lock"):  # a concurrent build may prune the image: link it while locked
        for name in ("vmlinux", "rootfs.cpio"):
            _link_or_copy(manifest.directory / name, work / name)
        deb, stdlib_deb = packages.download(cache / "debs", [inputs.kernel_package, stdlib])
    key = (inspect.getsource(_modules_cpio), _MODULE_GLOBS, (SRC_PKG / "images" / "kernel.py").read_bytes())
    mods = _cached(
        lab_cache / f"modules-{release}-{_digest(inputs.kernel_package.to_json(), LAB_MODULES, *key)}.cpio",
        lambda tmp: _modules_cpio(deb, release, tmp),
    )
    _link_or_copy(mods, work / "modules.cpio")
    return LabParts(work / "vmlinux", work / "rootfs.cpio", work / "modules.cpio", stdlib_deb, release)


def build_lab_image(
    work: Path,
    with_qemu: bool = False,
    parts: LabParts | None = None,
    extra: dict[str, Path] | None = None,
    name: str = "",
) -> LabImage:
    """The initrd the lab boots, in `work` (a directory this run owns): rootfs + modules [+ QEMU] + overlay.

    `extra`: more files for the overlay (guest path → file here); `name` tells images in one `work` apart."""
    t0 = time.monotonic()
    parts = parts or lab_parts(work)
    archives = [parts.rootfs, parts.modules]
    if with_qemu:
        binary = Path(shutil.which(QEMU) or QEMU)
        st = binary.stat()
        bundle = _cached(
            SHARED_CACHE / "lab" / f"qemu-{_digest(st.st_size, st.st_mtime_ns, QEMU_FIRMWARE)}.cpio", _qemu_cpio
        )
        _link_or_copy(bundle, work / "qemu.cpio")
        archives.append(work / "qemu.cpio")
    tag = name or ("qemu" if with_qemu else "base")
    overlay = work / f"overlay-{tag}.cpio"
    _overlay_cpio(overlay, parts.stdlib_deb if with_qemu else None, extra)
    archives.append(overlay)
    initrd = work / f"initrd-{tag}.img"
    with initrd.open("wb") as out:
        for p in archives:
            with p.open("rb") as src:
                shutil.copyfileobj(src, out)
    return LabImage(parts.vmlinux, initrd, parts.kernel_release, time.monotonic() - t0, initrd.stat().st_size)


@dataclass
class BootResult:
    results: dict[str, dict[str, Any]]
    ready_s: float  # QEMU start → the runner's first line
    total_s: float  # QEMU start → done
    attempts: int
    console: str
    timings: dict[str, float] = field(default_factory=dict)

    def scenario(self, name: str) -> dict[str, Any]:
        """The scenario's observations; its traceback (and the console tail) as the failure when it raised."""
        r = self.results.get(name)
        if r is None:
            raise LabError(f"scenario {name} produced no result\n{self.console[-3000:]}")
        if not r["ok"]:
            raise LabError(f"scenario {name} raised in the guest:\n{r['error']}")
        result: dict[str, Any] = r["result"]
        return result


def _parse(console: str) -> tuple[dict[str, dict[str, Any]], bool, bool]:
    results, ready, done = {}, False, False
    for line in console.splitlines():
        i = line.find("LAB {")
        if i < 0:
            continue
        try:
            obj = json.loads(line[i + 4 :])
        except ValueError:
            continue
        if obj.get("ready"):
            ready = True
        if obj.get("done"):
            done = True
        if "scenario" in obj:
            results[obj["scenario"]] = obj
    return results, ready, done


def _qemu_cmd(
    image: LabImage,
    log: Path,
    plan: list[str],
    iommu: bool,
    memory_mib: int,
    timeout_s: int,
    modules: str,
    extra_args: tuple[str, ...] = (),
) -> list[str]:
    append = f"{CMDLINE} lab.plan={','.join(plan)} lab.timeout={timeout_s} lab.modules={modules}"
    if iommu:
        append += " intel_iommu=on"
    return [
        QEMU, "-nodefaults", "-no-user-config", "-display", "none",
        "-machine", "q35,kernel-irqchip=split", "-accel", "tcg,tb-size=64", "-cpu", "max", "-smp", "1",
        "-m", str(memory_mib),
        *(["-device", "intel-iommu,intremap=on,caching-mode=on"] if iommu else []),
        "-kernel", str(image.vmlinux), "-initrd", str(image.initrd),
        "-serial", f"file:{log}", "-no-reboot", "-append", append,
        *LAB_DEVICES,
        *extra_args,
    ]  # fmt: skip


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what this boot started
    proc.wait()


MAX_LOAD_SCALE = MAX_DEADLINE_SCALE


def load_scale() -> float:
    """How much longer than on an idle machine a TCG boot may take now: the 1-minute load per core, from 1 up to
    MAX_LOAD_SCALE (at load 12-18 on 2 cores the fixed allowances ran out and the lab errored); the rule the
    guest's own deadlines follow (protocol/agent_protocol.deadline_scale)."""
    return deadline_scale(os.getloadavg()[0], os.cpu_count() or 1)


def boot(
    image: LabImage,
    work: Path,
    plan: list[str],
    *,
    iommu: bool = True,
    memory_mib: int = 512,
    ready_timeout_s: float = 60.0,
    total_timeout_s: float = 240.0,
    scenario_timeout_s: int = 60,
    retries: int = 1,
    modules: str = "scenarios",
    extra_args: tuple[str, ...] = (),
) -> BootResult:
    """Boot the lab guest, run `plan`, return its results. A boot that never reaches the runner is retried. The
    deadlines are for an idle machine and stretch with its load (`load_scale`).
    `extra_args`: more QEMU arguments for the lab guest's machine (later options win: `-cpu` replaces the default)."""
    if shutil.which(QEMU) is None:
        raise LabError(f"{QEMU} missing: run scripts/install-system-deps.sh")
    scale = load_scale()
    ready_timeout_s, total_timeout_s = ready_timeout_s * scale, total_timeout_s * scale
    scenario_timeout_s = int(scenario_timeout_s * scale)
    last = ""
    for attempt in range(1, retries + 2):
        log = work / f"console-{os.getpid()}-{time.monotonic_ns()}.log"
        cmd = _qemu_cmd(image, log, plan, iommu, memory_mib, scenario_timeout_s, modules, extra_args)
        t0 = time.monotonic()
        with (work / "qemu-stderr.log").open("ab") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        ready_s: float | None = None
        try:
            while True:
                console = log.read_text(errors="replace") if log.exists() else ""
                results, ready, done = _parse(console)
                now = time.monotonic() - t0
                if ready and ready_s is None:
                    ready_s = now
                if done or proc.poll() is not None:
                    break
                if (ready_s is None and now > ready_timeout_s) or now > total_timeout_s:
                    break
                time.sleep(0.1)
        finally:
            _stop(proc)
        console = log.read_text(errors="replace") if log.exists() else ""
        results, ready, done = _parse(console)
        total = time.monotonic() - t0
        if ready:
            if not done:
                missing = [p for p in plan if p not in results]
                raise LabError(f"lab run stopped after {total:.0f} s; no result for {missing}\n{console[-4000:]}")
            return BootResult(results, ready_s or total, total, attempt, console)
        last = console[-4000:] + (work / "qemu-stderr.log").read_text(errors="replace")[-1000:]
    raise LabError(f"lab guest never reached its runner ({retries + 1} boots)\n{last}")
