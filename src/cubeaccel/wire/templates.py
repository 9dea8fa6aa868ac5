"""Reading accelerator templates from YAML or JSON into `model.Template`, rejecting anything unexpected.

This is the edge: pydantic checks the document's shape (unknown fields, missing fields, types) and every
failure becomes a `CubeError` with a stable `template.*` code and the field path. Whether the values make
sense together (CUDA vs driver, modules vs kernel) is `contract.check_template`'s job, so that it can name
the layer; this module only guarantees the values are there and of the right kind.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from cubeaccel.model.template_spec import API_VERSION, KIND, Template
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire import json_guard

MAX_TEMPLATE_BYTES = 1 << 20
MAX_TEMPLATE_VALUES = 100_000  # a real template has under 200; YAML aliases can multiply a small file
HexId = Annotated[StrictStr, Field(pattern=r"^(0x)?[0-9a-fA-F]{4}$")]
Name = Annotated[StrictStr, Field(min_length=1, max_length=200)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TemplateMetadata(_Strict):
    name: Name
    version: Name
    description: Annotated[StrictStr, Field(max_length=2000)] = ""


class TemplateDevice(_Strict):
    vendor_id: HexId
    device_id: HexId
    labels: dict[StrictStr, StrictStr] = {}
    min_memory_gib: Annotated[StrictInt, Field(ge=0)] | None = None


class TemplateAccelerator(_Strict):
    class_: Annotated[Name, Field(alias="class")]
    backend: Name
    devices: list[TemplateDevice]


class TemplateDigest(_Strict):
    digest: Name


class TemplateKernel(_Strict):
    version: Name
    digest: Name


class TemplateModulesImg(_Strict):
    kernel_version: Name
    digest: Name


class TemplateInit(_Strict):
    load_modules: StrictBool = True
    persistence_mode: StrictBool = False


class TemplateGuest(_Strict):
    image: TemplateDigest
    kernel: TemplateKernel
    modules_img: TemplateModulesImg
    init: TemplateInit | None = None


class TemplateKernelDriver(_Strict):
    module: Name
    version: Name


class TemplateUserspace(_Strict):
    version: Name
    libraries: list[Name] = []


class TemplateDriver(_Strict):
    kernel: TemplateKernelDriver | None = None
    userspace: TemplateUserspace | None = None


class TemplateCuda(_Strict):
    version: Name
    compatibility: Literal["toolkit", "minor_version"] = "toolkit"


class TemplateMemory(_Strict):
    size_mib: StrictInt
    pinned: StrictBool


class TemplateProbes(_Strict):
    modules: list[Name] = []
    device_files: list[Name] = []
    libraries: list[Name] = []


class TemplateNetwork(_Strict):
    mode: Literal["none", "allowlist"] = "none"
    egress: list[Annotated[StrictStr, Field(max_length=40)]] = Field(default=[], max_length=64)


class TemplateMount(_Strict):
    source: Annotated[StrictStr, Field(min_length=1, max_length=200)]
    target: Annotated[StrictStr, Field(min_length=1, max_length=200)]


class TemplateFilesystem(_Strict):
    scratch_mib: StrictInt | None = None
    readonly_mounts: list[TemplateMount] = Field(default=[], max_length=16)


class TemplateSandbox(_Strict):
    """What the sandbox may reach (model/sandbox_policy.py); the last five exist to be refused with a code."""

    network: TemplateNetwork | None = None
    filesystem: TemplateFilesystem | None = None
    nested_virtualization: StrictBool = False
    privileged: StrictBool = False
    host_namespaces: list[Name] = Field(default=[], max_length=16)
    device_sharing: Literal["exclusive", "mig", "vgpu", "time_slicing"] = "exclusive"
    lifecycle: list[Literal["snapshot", "clone", "pause"]] = Field(default=[], max_length=3)


class TemplateSpec(_Strict):
    accelerator: TemplateAccelerator | None = None  # absent: a CPU-only template (template_spec.NO_ACCELERATOR)
    guest: TemplateGuest
    driver: TemplateDriver | None = None
    cuda: TemplateCuda | None = None
    memory: TemplateMemory
    hotplug: StrictBool
    probes: TemplateProbes = TemplateProbes()
    sandbox: TemplateSandbox | None = None


class TemplateDocument(_Strict):
    """The template file as an operator writes it; `apiVersion` is its version (parse_template names a wrong one)."""

    apiVersion: Literal["cubeaccel/v1"]  # spelled as in the file; = template_spec.API_VERSION
    kind: Literal["AcceleratorTemplate"]  # = template_spec.KIND
    metadata: TemplateMetadata
    spec: TemplateSpec


_CODES = {"extra_forbidden": "template.unknown_field", "missing": "template.missing_field"}


def _schema_error(e: ValidationError, source: str) -> CubeError:
    errors = []
    for err in e.errors():
        path = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if err["type"] == "string_type" and isinstance(err.get("input"), int | float):
            msg += " (write version numbers in quotes: YAML reads 12.10 as the number 12.1)"
        errors.append({"field": path, "code": _CODES.get(err["type"], "template.invalid_field"), "message": msg})
    # A misspelt field shows up as one unknown and one missing field; the unknown one names the typo.
    order = {"template.unknown_field": 0, "template.missing_field": 1}
    errors.sort(key=lambda x: order.get(x["code"], 2))
    first = errors[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return CubeError(
        first["code"],
        f"{source}: {first['field']}: {first['message']}{more}",
        "template",
        details={"errors": errors},
        status=422,
    )


def parse_template(data: object, source: str = "template") -> Template:
    """A parsed YAML/JSON value (dict) → Template, or a `template.*` CubeError."""
    if not isinstance(data, dict):
        raise CubeError(
            "template.not_a_mapping", f"{source}: expected a mapping, got {type(data).__name__}", "template"
        )
    if data.get("apiVersion") != API_VERSION:
        raise CubeError(
            "template.unsupported_api_version",
            f"{source}: apiVersion must be {API_VERSION!r}, got {data.get('apiVersion')!r}",
            "template",
        )
    if data.get("kind") != KIND:
        raise CubeError("template.wrong_kind", f"{source}: kind must be {KIND!r}, got {data.get('kind')!r}", "template")
    try:
        doc = TemplateDocument.model_validate(data)
    except ValidationError as e:
        raise _schema_error(e, source) from e
    return Template.from_json(doc.model_dump(by_alias=True))


def loads_document(text: str, source: str = "template") -> object:
    """YAML (a superset of JSON) text → the value it holds. Duplicate keys are not caught by PyYAML; JSON's are."""
    if len(text.encode()) > MAX_TEMPLATE_BYTES:
        raise CubeError("template.too_large", f"{source}: larger than {MAX_TEMPLATE_BYTES} bytes", "template")
    stripped = text.lstrip()
    too_deep = CubeError("template.too_deep", f"{source}: nested deeper than {json_guard.MAX_DEPTH} levels", "template")
    try:
        if stripped.startswith("{"):
            try:
                data: Any = json.loads(text)
            except json.JSONDecodeError as e:
                raise CubeError("template.invalid_json", f"{source}: {e}", "template") from e
        else:
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise CubeError("template.invalid_yaml", f"{source}: {e}", "template") from e
    except RecursionError:
        raise too_deep from None
    try:
        json_guard.check_value(data, max_nodes=MAX_TEMPLATE_VALUES)
    except json_guard.JsonRefused as e:
        if e.code == "api.too_deep":
            raise too_deep from None
        code = "template.too_large" if e.code == "api.too_many_values" else "template.invalid_field"
        raise CubeError(code, f"{source}: {e}", "template", status=422) from None
    return data


def load_document(path: str | Path) -> object:
    """A template file's (.yaml, .yml or .json) value, unchecked: for sending to CubeMaster, which checks it.

    Only a regular file is read, and only up to the size limit: `/dev/zero` read until MemoryError, and
    `/dev/urandom` or a FIFO with no writer hung (opened non-blocking, checked before any read)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError as e:
        raise CubeError("template.not_found", f"no such template file: {p}", "template") from e
    except OSError as e:
        raise CubeError("template.unreadable", f"cannot read {p}: {e.strerror}", "template") from e
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise CubeError("template.unreadable", f"cannot read {p}: Is a directory", "template")
        if not stat.S_ISREG(mode):
            raise CubeError("template.not_a_file", f"{p} is not a regular file (a device, FIFO or socket)", "template")
        chunks, size = [], 0
        while size <= MAX_TEMPLATE_BYTES and (chunk := os.read(fd, 65536)):
            chunks.append(chunk)
            size += len(chunk)
        raw = b"".join(chunks)[: MAX_TEMPLATE_BYTES + 1]
    except OSError as e:
        raise CubeError("template.unreadable", f"cannot read {p}: {e.strerror}", "template") from e
    finally:
        os.close(fd)
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise CubeError("template.invalid_encoding", f"{p}: not UTF-8 ({e.reason})", "template") from e
    return loads_document(text, str(p))


def loads_template(text: str, source: str = "template") -> Template:
    return parse_template(loads_document(text, source), source)


def load_template(path: str | Path) -> Template:
    """Read a template file (.yaml, .yml or .json)."""
    return parse_template(load_document(path), str(path))
