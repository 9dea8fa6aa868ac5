"""Template registry: register (contract stage 1), list, show, delete; versions; a default per class.

A template is registered only if `check_template` finds nothing wrong; the refusal names the layer
(422 `template.invalid`, with every violation in `details`). Versions are immutable: the same
name+version with another document is a 409. By name alone, the latest registered version is used;
`name@version` picks one. Sandboxes freeze the version they were created with.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

from cubeaccel.master.records import TemplateRecord
from cubeaccel.master.store import MasterStore
from cubeaccel.model.contract import CompatibilityContract, Template, check_template, freeze
from cubeaccel.model.request import validate_class
from cubeaccel.protocol.errors import CubeError
from cubeaccel.wire import master_api as W
from cubeaccel.wire.templates import parse_template

RowT = TypeVar("RowT", bound=W.TemplateRow)


class Registry:
    def __init__(self, store: MasterStore) -> None:
        self.store = store
        self._frozen: dict[tuple[str, str], CompatibilityContract] = {}

    def register(self, document: object, default: bool = False) -> W.TemplateRegistered:
        t = parse_template(document, "template")
        violations = check_template(t)
        if violations:
            v = violations[0]
            raise CubeError(
                "template.invalid",
                f"template {t.name} is inconsistent ({v.layer.value}): {v.code}: "
                f"expected {v.expected}, found {v.found}",
                v.layer.value,
                {"violations": [x.to_json() for x in violations]},
            )
        c = freeze(t)
        created = self.store.put_template(t.name, t.version, t.accel_class, c.digest, t.to_json(), time.time())
        if default:
            self.set_default(t.accel_class, t.name)
        return W.TemplateRegistered(
            name=t.name,
            version=t.version,
            accel_class=t.accel_class,
            backend=t.backend,
            digest=c.digest,
            created=created,
            default=default or self.is_default(t),
        )

    def set_default(self, accel_class: str, name: str) -> None:
        validate_class(accel_class)
        if self.store.template(name) is None:
            raise CubeError("template.not_found", f"no template {name!r}", "template")
        self.store.set_default(accel_class, name)

    def is_default(self, t: Template) -> bool:
        return self.store.defaults().get(t.accel_class) == t.name

    def contract(self, ref: str) -> CompatibilityContract:
        """`name` (latest version) or `name@version` → the frozen contract a sandbox will copy."""
        name, _, version = ref.partition("@")
        row = self.store.template(name, version or None)
        if row is None:
            raise CubeError(
                "template.unknown",
                f"no template {ref!r} is registered",
                "template",
                {"template": ref, "known": sorted({r.name for r in self.store.templates()})},
            )
        key = (row.name, row.version)
        c = self._frozen.get(key)
        if c is None:
            c = self._frozen[key] = freeze(Template.from_json(row.document))
        return c

    def default_for(self, accel_class: str) -> CompatibilityContract:
        name = self.store.defaults().get(accel_class)
        if name is None:
            raise CubeError(
                "template.no_default",
                f"no template given and no default template for class {accel_class!r}; register one with default=true",
                "template",
                {"class": accel_class},
            )
        return self.contract(name)

    def show(self, ref: str) -> W.TemplateShown:
        name, _, version = ref.partition("@")
        row = self.store.template(name, version or None)
        if row is None:
            raise CubeError("template.not_found", f"no template {ref!r}", "template")
        versions = [r.version for r in self.store.templates() if r.name == name]
        return self._row(row, W.TemplateShown, versions=versions, document=row.document)

    def list(self) -> list[W.TemplateRow]:
        return [self._row(r, W.TemplateRow) for r in self.store.templates()]

    def delete(self, ref: str) -> W.TemplateDeleted:
        name, _, version = ref.partition("@")
        n = self.store.delete_template(name, version or None)
        if n == 0:
            raise CubeError("template.not_found", f"no template {ref!r}", "template")
        return W.TemplateDeleted(deleted=n, template=ref)

    def _row(self, r: TemplateRecord, model: type[RowT], **extra: Any) -> RowT:
        return model(
            name=r.name,
            version=r.version,
            accel_class=r.accel_class,
            digest=r.digest,
            default=self.store.defaults().get(r.accel_class) == r.name,
            created_at=r.created_at,
            **extra,
        )
