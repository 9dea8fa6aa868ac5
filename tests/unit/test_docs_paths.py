"""Every file, module and `file.py::name` that docs/*.md names exists: a doc that sends a reader to a module
that was renamed or deleted is wrong, and only a test notices."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PACKAGE = ROOT / "src" / "cubeaccel"
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())

# A relative path with at least one directory, not part of an absolute path or a URL.
PATH = re.compile(r"(?<![\w./~<>$-])((?:[\w.-]+/)+[\w-]+\.(?:py|md|yaml|yml|sh|toml|json|html))(?![\w/])")
# `some/file.py::name`; a name that ends in an ellipsis is a prefix.
NAMED = re.compile(r"((?:[\w.-]+/)+[\w-]+\.py)::(\w+)(…|\.\.\.)?")
# `cubeaccel.<subpackage>[.module][.attribute]`
MODULE = re.compile(r"(?<![\w./])cubeaccel((?:\.\w+)+)")
# A bare `test_*.py` a doc names without its directory.
BARE_TEST = re.compile(r"(?<![\w./-])(test_\w+\.py)(?![\w/])")

# Named on purpose although absent: the reason is the value.
ABSENT = {
    "tests/unit/test_cloudhv.py": "decisions.md says it was deleted with the cloud-hypervisor backend",
    "XDG_CONFIG_HOME/cubeaccel/config.toml": "a path under an environment variable",
}


def _outside(path: str, doc: Path) -> bool:
    """A path that leaves the repository (the team's `shared/` beside the clone, or any `..` that climbs out): a
    user's clone has nothing there, so a doc may not send anyone to it."""
    parts = Path(path).parts
    climbed = [p for p in parts if p != ".."]
    if climbed and climbed[0] == "shared":
        return True
    return ".." in parts and not (doc.parent / path).resolve().is_relative_to(ROOT)


def _resolve(path: str, doc: Path) -> Path | None:
    if _outside(path, doc):
        return None
    for base in (ROOT, PACKAGE, ROOT / "src", doc.parent):
        if (base / path).exists():
            return base / path
    return None


@cache
def _test_files() -> frozenset[str]:
    return frozenset(p.name for p in (ROOT / "tests").rglob("test_*.py"))


def _defines(source: str, name: str, prefix: bool) -> bool:
    tail = r"\w*" if prefix else r"\b"
    top = rf"^(?:async\s+def|def|class)\s+{name}{tail}|^{name}{tail}\s*[:=]"
    nested = rf"^\s+(?:async\s+def|def)\s+{name}{tail}"  # a method (test classes, protocols)
    return re.search(top, source, re.M) is not None or re.search(nested, source, re.M) is not None


def _module_problem(dotted: str) -> str | None:
    """None when `cubeaccel.<dotted>` is a module, or a module and a name it defines; else what is missing."""
    parts = dotted.strip(".").split(".")
    for i in range(len(parts), 0, -1):
        base = PACKAGE.joinpath(*parts[:i])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            rest = parts[i:]
            if rest and not _defines(source.read_text(), rest[0], prefix=False):
                return f"{source.relative_to(ROOT)} defines no {rest[0]}"
            return None
    return "no such module"


def names_in(text: str, doc: Path) -> list[str]:
    """What `text` (a doc's body) names that does not exist, one line each."""
    missing = []
    for path in sorted(set(PATH.findall(text)) - set(ABSENT)):
        if _outside(path, doc):
            missing.append(f"outside the repository {path}")
        elif _resolve(path, doc) is None:
            missing.append(f"file {path}")
    for path, name, ellipsis in sorted(set(NAMED.findall(text))):
        found = _resolve(path, doc)
        if found is not None and found.is_file() and not _defines(found.read_text(), name, prefix=bool(ellipsis)):
            missing.append(f"{path}::{name}{ellipsis}")
    for dotted in sorted(set(MODULE.findall(text))):
        if dotted.strip(".").split(".")[0] in SUBPACKAGES and (problem := _module_problem(dotted)):
            missing.append(f"cubeaccel{dotted}: {problem}")
    for name in sorted(set(BARE_TEST.findall(text))):
        if name not in _test_files() and not any(p.endswith("/" + name) for p in ABSENT):
            missing.append(f"test file {name}")
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_path_module_and_name_a_doc_gives_exists(doc: Path) -> None:
    assert names_in(doc.read_text(), doc) == []


def test_the_check_finds_each_kind_of_dangling_reference() -> None:
    doc = ROOT / "docs" / "shim.md"
    text = (
        "`cubeaccel.shim.find.find_vmm`, `cubeaccel.host.nowhere`, `src/cubeaccel/host/gone.py`, "
        "`wire/heartbeat.py::NoSuchModel`, `tests/unit/test_docs_paths.py::test_nothing_like_this…`, "
        "`test_never_written.py`, `../shared/notes/vfio-nested-lab.md`, `shared/seed/design.md`"
    )
    assert names_in(text, doc) == [
        "outside the repository ../shared/notes/vfio-nested-lab.md",
        "outside the repository shared/seed/design.md",
        "file src/cubeaccel/host/gone.py",
        "tests/unit/test_docs_paths.py::test_nothing_like_this…",
        "wire/heartbeat.py::NoSuchModel",
        "cubeaccel.host.nowhere: src/cubeaccel/host/__init__.py defines no nowhere",
        "cubeaccel.shim.find.find_vmm: src/cubeaccel/shim/__init__.py defines no find",
        "test file test_never_written.py",
    ]


def test_names_that_exist_pass() -> None:
    doc = ROOT / "docs" / "shim.md"
    text = (
        "`cubeaccel.host.vmm.vmmproc.find_vmm`, `python -m cubeaccel.shim`, `host/vmm/vmmproc.py`, "
        "`wire/heartbeat.py::Heartbeat`, `tests/unit/test_docs_paths.py::test_the_check_finds…`, "
        "`test_docs_paths.py`, `cubeaccel.tenant:` (not a module)"
    )
    assert names_in(text, doc) == []
