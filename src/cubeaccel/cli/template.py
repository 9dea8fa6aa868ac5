"""`cubeaccel template ...`: validate a template file offline and show what a sandbox would freeze.

`validate` runs the registration stage (`check_template`) exactly as CubeMaster will, so an operator sees
every layer-named violation before registering. Exit status: 0 consistent, 1 violations or unreadable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cubeaccel.model.bars import Bar
from cubeaccel.model.contract import ContractViolation, check_template, freeze
from cubeaccel.model.device import DeviceRecord
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire.templates import load_template

if TYPE_CHECKING:
    from cubeaccel.wire.snapshot import SnapshotPlan

app = typer.Typer(no_args_is_help=True, help="accelerator templates: validate, show, prepare snapshots")

FileArg = typer.Argument(..., help="template file (.yaml, .yml or .json)", show_default=False)
AsJson = typer.Option(False, "--json", help="print JSON instead of a table")


def _violations_table(title: str, rows: list[ContractViolation]) -> Table:
    # Layer and code are what scripts and people grep for: never wrapped or cut, whatever the width.
    table = Table(title=title, show_lines=True)
    table.add_column("layer", no_wrap=True, min_width=max(len(v.layer.value) for v in rows))
    table.add_column("code", no_wrap=True, min_width=max(len(v.code) for v in rows))
    for name, width in (("expected", 18), ("found", 14), ("hint", 20)):
        table.add_column(name, overflow="fold", min_width=width)
    for v in rows:
        table.add_row(v.layer.value, v.code, escape(v.expected), escape(v.found), escape(v.hint))
    return table


def _machine() -> bool:
    from cubeaccel.cli import output

    return output.machine()


def _console(stderr: bool = False) -> Console:
    """A terminal gets its own width; a pipe or a log gets a wide one, so table rows stay readable."""
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=200)


def _load_error(file: Path, e: CubeError, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"file": str(file), "ok": False, **e.to_json()}, indent=2))
    else:
        console = _console(stderr=True)
        console.print(f"[red]invalid template[/] {escape(str(file))}: [bold]{e.code}[/] ({e.layer})")
        console.print(escape(e.message))
        for err in e.details.get("errors", [])[1:]:
            console.print(f"  {escape(err['field'])}: {escape(err['message'])} [dim]({err['code']})[/]")
    raise typer.Exit(1)


@app.command("validate")
def validate(file: Path = FileArg, as_json: bool = AsJson) -> None:
    """Check a template's internal consistency (registration stage). Exit 1 on any violation."""
    as_json = as_json or _machine()
    try:
        t = load_template(file)
    except CubeError as e:
        _load_error(file, e, as_json)
        return
    violations = check_template(t)
    ok = not violations
    if as_json:
        out: dict[str, Any] = {
            "file": str(file),
            "ok": ok,
            "template": {"name": t.name, "version": t.version},
            "violations": [v.to_json() for v in violations],
        }
        if ok:
            out["template"]["digest"] = freeze(t).digest
        typer.echo(json.dumps(out, indent=2))
    else:
        console = _console()
        if ok:
            console.print(
                f"[green]ok[/]: {escape(t.name)} version {escape(t.version)} is consistent "
                f"(contract digest {freeze(t).digest})"
            )
        else:
            title = f"{escape(t.name)} version {escape(t.version)}: {len(violations)} violation(s)"
            console.print(_violations_table(title, violations))
    raise typer.Exit(0 if ok else 1)


@app.command("show")
def show(file: Path = FileArg, as_json: bool = AsJson) -> None:
    """Show the template as it would be frozen into a sandbox: canonical document, digest, guest probes."""
    as_json = as_json or _machine()
    try:
        t = load_template(file)
    except CubeError as e:
        _load_error(file, e, as_json)
        return
    contract = freeze(t)
    if as_json:
        typer.echo(json.dumps(contract.to_json(), indent=2))
        return
    console = _console()
    table = Table("field", "value", title=f"template {escape(t.name)} version {escape(t.version)}")
    rows: list[tuple[str, str]] = [
        ("digest", contract.digest),
        ("class / backend", f"{t.accel_class} / {t.backend}"),
        ("devices", ", ".join(d.vendor_device + (f" {d.labels}" if d.labels else "") for d in t.devices) or "-"),
        ("guest image", t.guest_image_digest),
        ("guest kernel", f"{t.guest_kernel.version} ({t.guest_kernel.digest})"),
        ("modules.img", f"{t.modules_img.kernel_version} ({t.modules_img.digest})"),
        ("kernel driver", f"{t.kernel_driver.module} {t.kernel_driver.version}" if t.kernel_driver else "-"),
        ("user-space driver", t.userspace_driver.version if t.userspace_driver else "-"),
        ("CUDA", f"{t.cuda.version} ({t.cuda.compatibility})" if t.cuda else "-"),
        ("memory", f"{t.memory_mib} MiB, {'pinned' if t.pin_memory else 'not pinned'}"),
        ("hot-plug", "yes" if t.hotplug else "no"),
    ]
    for k, v in rows:
        table.add_row(k, escape(v))
    console.print(table)
    console.print("guest probes (what cube-agent checks):")
    console.print_json(json.dumps(contract.guest_probes().to_json()))
    problems = check_template(t)
    if problems:
        console.print(f"[yellow]{len(problems)} violation(s)[/]: run `cubeaccel template validate {escape(str(file))}`")


def _prepare_error(e: CubeError, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"ok": False, **e.to_json()}, indent=2))
    else:
        _console(stderr=True).print(f"[red]not prepared[/]: [bold]{e.code}[/] {escape(e.message)}")
    raise typer.Exit(1)


@app.command("prepare")
def prepare_cmd(
    file: Path | None = typer.Argument(
        None, help="a template file: its memory size and guest image", show_default=False
    ),
    memory_mib: int | None = typer.Option(None, "--memory-mib", min=64, help="the shape's guest memory (no FILE)"),
    vcpus: int = typer.Option(1, "--vcpus", min=1, max=256),
    memory_backend: str = typer.Option("ram", "--memory-backend", help="ram | memfd | hugepages"),
    image: str | None = typer.Option(None, "--image", help="guest image digest (default: FILE's, else the newest)"),
    plan: Path | None = typer.Option(
        None, "--plan", help="a snapshot plan (JSON, wire.snapshot.SnapshotPlan): what the Cubelet queues"
    ),
    state_dir: Path | None = typer.Option(
        None, "--state-dir", help="FILE: the Cubelet whose devices shape the machine (default: this host's)"
    ),
    as_json: bool = AsJson,
) -> None:
    """Make this node's template snapshot of one machine shape now, so no tenant's start waits for it.

    Sandboxes of a shape with no snapshot boot cold (`start.cold_no_snapshot`). A machine's root ports are
    shaped by the BARs of the devices it may receive: with FILE, those of the devices this node's Cubelet has
    that the template admits (none when no Cubelet answers: say so); --memory-mib makes the machine of a
    sandbox with no device. The Cubelet plans its own (`--prepare-template`, `--prepare-shape`, warm pools) and
    runs `--plan` for each."""
    from cubeaccel.images.builder import cache_dir, find_image, latest
    from cubeaccel.model.snapshot_layouts import snapshot_layouts
    from cubeaccel.shim.template import prepare_template, shape_config
    from cubeaccel.wire.snapshot import plan_label

    as_json = as_json or _machine()
    digest = image
    planned = _read_plan(plan, as_json) if plan is not None else None
    bars: tuple[tuple[Bar, ...], ...] = ()
    label, shaped_for = None, "no device (--memory-mib)"
    if planned is not None:
        memory_mib, vcpus, memory_backend = planned.memory_mib, planned.vcpus, planned.memory_backend
        digest, bars, label, shaped_for = planned.image_digest, planned.template_bars, planned.label, "the plan"
    elif file is not None:
        try:
            t = load_template(file)
        except CubeError as e:
            _load_error(file, e, as_json)
            return
        memory_mib, digest = t.memory_mib, image or t.guest_image_digest
        devices, where = _node_devices(state_dir)
        shaped_for = where
        if devices is not None:
            bars = snapshot_layouts(freeze(t), devices)[0]
            shaped_for = (
                f"the {len(bars)} BAR layout(s) the template admits among the devices of the Cubelet at {where}"
            )
        label = plan_label(t.name, t.memory_mib, vcpus, bars)
    if memory_mib is None or memory_backend not in ("ram", "memfd", "hugepages"):
        raise typer.BadParameter("give a template FILE or --memory-mib; --memory-backend is ram, memfd or hugepages")
    manifest = find_image(digest) if digest else latest()
    if manifest is None:
        err = CubeError(
            "template.prepare_failed",
            f"guest image {digest or '(newest)'} is not in {cache_dir() / 'images'}: run `cubeaccel image build`",
            layer="template",
            details={"plan": label, "shaped_for": shaped_for},
        )
        _prepare_error(err, as_json)
        return
    root = cache_dir() / "templates"
    try:
        cfg = shape_config(manifest, memory_mib, vcpus, root / "prepare", memory_backend, bars)
        state, created = prepare_template(cfg, manifest, root, prepared_for=label)
    except CubeError as e:
        details = {"cause": e.code, "plan": label, "shaped_for": shaped_for}
        _prepare_error(CubeError("template.prepare_failed", e.message, "template", details), as_json)
        return
    meta = json.loads((state.parent / "meta.json").read_text())
    meta.pop("machine", None)  # the key's fields, kept for a start's lookup; `key` names them
    out = {"state": str(state), "created": created, **meta, "shaped_for": shaped_for}
    if as_json:
        typer.echo(json.dumps(out, indent=2))
    else:
        verb = "prepared" if created else "already prepared"
        typer.echo(f"{verb}: {memory_mib} MiB x {vcpus} vCPU ({memory_backend}) -> {state} ({meta.get('build_s')} s)")
        typer.echo(f"  root ports shaped for {shaped_for}")


def _node_devices(state_dir: Path | None) -> tuple[list[DeviceRecord] | None, str]:
    """The devices of this host's Cubelet (what shapes a template's machine) and its socket; (None, why) when no
    Cubelet answers: the machine is then the one of no device, and the output says so."""
    import httpx

    from cubeaccel.cli.locate import cubelet_socket
    from cubeaccel.transport.cubelet_client import CubeletClient

    sock = cubelet_socket(state_dir)
    if not sock.exists():
        return None, f"no device: no Cubelet at {sock} to ask for its devices' BARs (--state-dir)"
    client = CubeletClient(socket=sock)
    try:
        devices = [d.record() for d in client.devices()]
    except (CubeError, httpx.TransportError, OSError) as e:
        return None, f"no device: the Cubelet at {sock} did not answer ({type(e).__name__})"
    finally:
        client.close()
    return devices, str(sock)


def _read_plan(path: Path, as_json: bool) -> SnapshotPlan:
    from pydantic import ValidationError

    from cubeaccel.wire.snapshot import SnapshotPlan

    try:
        return SnapshotPlan.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as e:
        _prepare_error(
            CubeError("template.prepare_failed", f"{path}: not a snapshot plan: {e}"[:500], "template"), as_json
        )
        raise  # unreachable: _prepare_error exits


# ---- registered templates (CubeMaster) ------------------------------------------------------------------------
MasterOpt = typer.Option(None, "--master", help="CubeMaster URL (default: $CUBEACCEL_MASTER, then `cubeaccel up`'s)")


@app.command("list")
def list_cmd(url: str | None = MasterOpt, as_json: bool = AsJson) -> None:
    """Templates registered with CubeMaster: name, version, class, digest, and which is each class's default."""
    from cubeaccel.cli import output
    from cubeaccel.cli.master_access import call_master
    from cubeaccel.transport.master_client import Calls

    output.json_flag(as_json)
    body = call_master(url, lambda c: c.call(Calls.templates()))

    def table() -> None:
        t = Table(title="templates")
        t.add_column("name", no_wrap=True)
        t.add_column("version", no_wrap=True)
        t.add_column("class")
        t.add_column("default")
        t.add_column("digest", overflow="fold")
        for r in body.templates:
            t.add_row(r.name, r.version, r.accel_class, "yes" if r.default else "", r.digest)
        _console().print(t)

    output.emit({"templates": body.templates, "defaults": body.defaults}, table)


@app.command("delete")
def delete_cmd(
    ref: str = typer.Argument(..., help="NAME (every version) or NAME@VERSION"), url: str | None = MasterOpt
) -> None:
    """Delete a registered template (sandboxes already created keep their frozen contract)."""
    from cubeaccel.cli import output
    from cubeaccel.cli.master_access import call_master
    from cubeaccel.transport.master_client import Calls

    r = call_master(url, lambda c: c.call(Calls.delete_template(ref)))
    output.emit(r, lambda: _console().print(f"deleted {r.deleted} version(s) of {escape(r.template)}"))


# ---- pin: the real digests of this host's image, written into the file ---------------------------------------


def _get(doc: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def pin_yaml_text(text: str, values: dict[tuple[str, ...], str]) -> str:
    """Rewrite the scalar values at `values`' key paths in block-style YAML, leaving comments and layout alone.

    A path that is not in the text as `key: value` on its own line raises `template.pin_failed`."""
    import re

    lines = text.splitlines(keepends=True)
    stack: list[tuple[int, str]] = []  # (indent, key) of the mapping keys above the current line
    done: set[tuple[str, ...]] = set()
    key_re = re.compile(r"^(\s*)([A-Za-z0-9_.-]+):(\s*)(.*?)(\s+#.*)?(\r?\n)?$")
    for i, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith(("#", "-")):
            continue
        m = key_re.match(line)
        if m is None:
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (*(k for _, k in stack), m.group(2))
        if path in values and m.group(4):
            quote = '"' if m.group(4).startswith('"') else ""
            lines[i] = f"{m.group(1)}{m.group(2)}: {quote}{values[path]}{quote}{m.group(5) or ''}{m.group(6) or ''}"
            done.add(path)
        stack.append((indent, m.group(2)))
    missing = [".".join(p) for p in values if p not in done]
    if missing:
        raise CubeError(
            "template.pin_failed", f"no `key: value` line for {', '.join(missing)}", "template", {"missing": missing}
        )
    return "".join(lines)


@app.command("pin")
def pin_cmd(
    file: Path = FileArg,
    cache: Path | None = typer.Option(None, "--cache-dir", help="default: ~/.cache/cubeaccel"),
    build: bool = typer.Option(True, "--build/--no-build", help="build (or reuse) the image first"),
    check: bool = typer.Option(False, "--check", help="change nothing; exit 1 if the file's digests differ"),
    vendor: str | None = typer.Option(
        None, "--vendor", help="the GPU image with this driver stack (nvidia): also pins driver and CUDA versions"
    ),
    flavour: str = typer.Option(
        "", "--flavour", help="the image flavour (validation, userland); default: the GPU templates' for --vendor"
    ),
) -> None:
    """Write the digests of the image this host builds (guest image, kernel, modules.img) into FILE; with
    --vendor, the GPU image's, and its driver and CUDA driver API versions too."""
    from cubeaccel.cli import output
    from cubeaccel.images.builder import GPU_FLAVOUR, flavour_named, image_label, latest, stack_named
    from cubeaccel.images.builder import build as build_image
    from cubeaccel.images.manifest import pin_template_document, pinned_paths
    from cubeaccel.wire.templates import loads_document

    try:
        stack = stack_named(vendor)
        kind = flavour_named(flavour or (GPU_FLAVOUR if stack is not None else None))
        image = build_image(cache, stack=stack, flavour=kind)[0] if build else latest(cache, image_label(kind, stack))
        if image is None:
            raise CubeError("image.manifest_invalid", "no image built yet: run `cubeaccel image build`", "template")
        text = file.read_text()
        doc = loads_document(text, file.name)
        if not isinstance(doc, dict):
            raise CubeError("template.pin_failed", f"{file} is not a template document", "template")
        want = pin_template_document(doc, image)
        values: dict[tuple[str, ...], str] = {p: str(_get(want, p)) for p in pinned_paths(doc, image)}
        changed = {".".join(p): {"from": str(_get(doc, p)), "to": v} for p, v in values.items() if _get(doc, p) != v}
        new = json.dumps(want, indent=2) + "\n" if file.suffix == ".json" else pin_yaml_text(text, values)
        if loads_document(new, file.name) != want:  # the rewrite is exactly the pinned document, nothing else
            raise CubeError("template.pin_failed", f"{file}: rewriting the digests changed more than them", "template")
    except (CubeError, OSError) as e:
        output.fail(e if isinstance(e, CubeError) else CubeError("template.pin_failed", str(e), "template"))
    if not check and changed:
        file.write_text(new)
    result = {"file": str(file), "image_digest": image.image_digest, "changed": changed, "written": not check}
    output.emit(
        result,
        lambda: _console().print(
            f"{escape(str(file))}: "
            + (
                ", ".join(f"{k} → {v['to']}" for k, v in changed.items())
                if changed
                else "already pinned to this host's image"
            )
            + (" (not written: --check)" if check and changed else "")
        ),
    )
    if check and changed:
        raise typer.Exit(1)
