"""`cubeaccel image ...`: build the guest image from Debian packages (cached), show its manifest."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from cubeaccel.protocol.errors import CubeError

app = typer.Typer(no_args_is_help=True, help="guest image: kernel, modules.img, rootfs with cube-agent")
FlavourOption = typer.Option(
    "",
    "--flavour",
    help="validation (cube-agent and bash only) or userland (E2B base's tools: git, curl, sudo, python3 with pip…);"
    " default: validation, or with --vendor the flavour the shipped GPU templates pin (userland)",
)


@app.command("build")
def build(
    force: bool = typer.Option(False, "--force", help="rebuild even when the cached image matches its inputs"),
    cache: Path | None = typer.Option(None, "--cache-dir", help="default: ~/.cache/cubeaccel"),
    vendor: str | None = typer.Option(
        None, "--vendor", help="a GPU image with this vendor's driver stack (nvidia); default: CPU-only"
    ),
    flavour: str = FlavourOption,
) -> None:
    """Build (or reuse) the image; prints its manifest path, digests and whether it was built now."""
    from cubeaccel.cli.output import Progress
    from cubeaccel.images.builder import GPU_FLAVOUR, flavour_named, stack_named
    from cubeaccel.images.builder import build as build_image

    t0 = time.monotonic()
    try:
        stack = stack_named(vendor)
        kind = flavour_named(flavour or (GPU_FLAVOUR if stack is not None else None))
        with Progress("image build") as progress:
            manifest, built = build_image(cache, force=force, on_phase=progress.phase, stack=stack, flavour=kind)
    except CubeError as e:
        print(json.dumps(e.to_json()), file=sys.stderr)
        raise typer.Exit(1) from e
    out = {
        "manifest": str(manifest.directory / "manifest.json"),
        "built": built,
        "seconds": round(time.monotonic() - t0, 2),
        **manifest.to_json(),
    }
    print(json.dumps(out, indent=2))


@app.command("show")
def show(
    cache: Path | None = typer.Option(None, "--cache-dir", help="default: ~/.cache/cubeaccel"),
    vendor: str | None = typer.Option(None, "--vendor", help="the GPU image of this driver stack (nvidia)"),
    flavour: str = FlavourOption,
) -> None:
    """The most recently built image's manifest of that flavour and stack (no apt queries); exit 1 if none."""
    from cubeaccel.images.builder import GPU_FLAVOUR, flavour_named, image_label, latest, stack_named

    try:
        stack = stack_named(vendor)
        kind = flavour_named(flavour or (GPU_FLAVOUR if stack is not None else None))
        manifest = latest(cache, image_label(kind, stack))
    except CubeError as e:
        print(json.dumps(e.to_json()), file=sys.stderr)
        raise typer.Exit(1) from e
    if manifest is None:
        print("no image built yet: run `cubeaccel image build`", file=sys.stderr)
        raise typer.Exit(1)
    bad = manifest.verify()
    print(
        json.dumps(
            {
                "manifest": str(manifest.directory / "manifest.json"),
                "intact": not bad,
                "corrupt": bad,
                **manifest.to_json(),
            },
            indent=2,
        )
    )


@app.command("import")
def import_(
    source: Path = typer.Argument(..., help="a directory holding manifest.json and the artifacts it names"),
    template: Path = typer.Option(..., "--template", help="the template (YAML/JSON) the image must satisfy"),
    cache: Path | None = typer.Option(None, "--cache-dir", help="default: ~/.cache/cubeaccel"),
) -> None:
    """Import a guest built elsewhere: its artifacts must match its manifest, and the manifest what the template
    pins (image, kernel, modules.img, driver and CUDA versions); then the node advertises it like its own."""
    from cubeaccel.images.builder import cache_dir
    from cubeaccel.images.importer import import_image
    from cubeaccel.wire.templates import loads_document

    try:
        doc = loads_document(template.read_text(), template.name)
        if not isinstance(doc, dict):
            raise CubeError("template.pin_failed", f"{template} is not a template document", "template")
        manifest = import_image(source, doc, cache or cache_dir())
    except OSError as e:
        err = CubeError("image.import_mismatch", f"cannot read {e.filename}: {e.strerror}", "template")
        print(json.dumps(err.to_json()), file=sys.stderr)
        raise typer.Exit(1) from e
    except CubeError as e:
        print(json.dumps(e.to_json()), file=sys.stderr)
        raise typer.Exit(1) from e
    print(json.dumps({"manifest": str(manifest.directory / "manifest.json"), **manifest.to_json()}, indent=2))
