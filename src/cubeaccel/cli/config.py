"""One TOML config file for every flag and environment variable (docs/config.md lists each one).

Precedence, for every setting: flag > environment > file > built-in default.

- Top-level keys are the settings that deep code and child processes read from the environment (the cache
  directory, QEMU, HTTP limits, the log level, where the servers are). They are validated here (pydantic-settings,
  the environment first, then the file) and the file's values are exported as `CUBEACCEL_*` variables that are not
  already set, so a shim or QEMU started by a Cubelet sees the same setting as the Cubelet.
- Tables named after a command (`[cubelet.serve]`, `[up]`, `[sandbox.create]`) hold that command's flags, by the
  flag's name (`state-dir` or `state_dir`). They become click's `default_map`, which click consults after the
  command line and after the flag's own environment variable (`CUBEACCEL_<COMMAND>_<FLAG>`, e.g.
  `CUBEACCEL_CUBELET_SERVE_BACKEND`), so the precedence is the same. An unknown table or key is an error naming it,
  not silently ignored.

The file: `--config FILE` (before the command), else `$CUBEACCEL_CONFIG`, else `$XDG_CONFIG_HOME/cubeaccel/config.toml`
(`~/.config/...`), else `/etc/cubeaccel/config.toml`; none is fine (defaults).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from cubeaccel.protocol.errors import CubeError

ENV_PREFIX = "CUBEACCEL_"


class Settings(BaseSettings):
    """Settings read through the environment, by name `CUBEACCEL_<FIELD>` (upper case)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", case_sensitive=False)

    # where the servers are (the CLI's clients)
    # CubeMaster URL; else the one `cubeaccel up` started, else http://127.0.0.1:7700 (`master` is a command table)
    master_url: str | None = Field(None, validation_alias=AliasChoices("master_url", "CUBEACCEL_MASTER"))
    api_key: str | None = None  # an API key itself (prefer api_key_file in a file)
    api_key_file: Path | None = None  # a file holding the API key (0600)
    sandbox_token: str | None = None  # a sandbox's access token for `sandbox exec/cp`
    # state directories (defaults under ~/.local/state/cubeaccel)
    state_dir: Path | None = None  # the Cubelet's (`cubelet serve`, and where `devices` looks first)
    master_state_dir: Path | None = None  # CubeMaster's (`master serve`)
    up_state_dir: Path | None = None  # `cubeaccel up`'s
    # images and VMs
    cache_dir: Path | None = None  # image and template-state cache (default $XDG_CACHE_HOME/cubeaccel)
    qemu: Path | None = None  # the qemu-system-x86_64 binary (default: on $PATH)
    accel: Literal["kvm", "tcg"] | None = None  # force QEMU's accelerator (default: kvm where it works)
    # the HTTP listeners' bounds (docs/api.md)
    http_header_timeout_s: float | None = None
    http_body_timeout_s: float | None = None
    http_idle_timeout_s: int | None = None
    # logging (structured JSON lines on stderr)
    log_level: Literal["debug", "info", "warning", "error"] | None = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (env_settings, init_settings)  # the file's values come in as init kwargs: below the environment


ENV_NAMES = {"master_url": "CUBEACCEL_MASTER"}  # older than the file; kept


def env_name(field: str) -> str:
    return ENV_NAMES.get(field, ENV_PREFIX + field.upper())


def default_path() -> Path | None:
    if os.environ.get("CUBEACCEL_CONFIG"):
        return Path(os.environ["CUBEACCEL_CONFIG"])
    xdg = os.environ.get("XDG_CONFIG_HOME")
    for p in ((Path(xdg) if xdg else Path.home() / ".config") / "cubeaccel" / "config.toml",):
        if p.is_file():
            return p
    system = Path("/etc/cubeaccel/config.toml")
    return system if system.is_file() else None


def _invalid(path: Path, message: str) -> CubeError:
    return CubeError("config.invalid", f"{path}: {message}", "api", {"file": str(path)})


def read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise _invalid(path, f"cannot read: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise _invalid(path, f"not TOML: {e}") from e


def split(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(environment-backed settings, command tables)."""
    fields = set(Settings.model_fields)
    return {k: v for k, v in raw.items() if k in fields}, {k: v for k, v in raw.items() if k not in fields}


def load_settings(path: Path | None, raw: dict[str, Any]) -> Settings:
    env_part, _ = split(raw)
    try:
        return Settings(**env_part)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise _invalid(path or Path("(environment)"), f"{where}: {first['msg']}") from e


def export(settings: Settings, from_file: dict[str, Any]) -> None:
    """The file's environment-backed settings become `CUBEACCEL_*` variables where none is set (env wins)."""
    for name in from_file:
        value = getattr(settings, name)
        if value is not None and env_name(name) not in os.environ:
            os.environ[env_name(name)] = str(value)


def default_map(root: Any, tables: dict[str, Any], path: Path) -> dict[str, Any]:
    """The command tables checked against the command tree: `{command: {sub: {param: value}}}` for click.

    `root` is the click command Typer builds (Typer vendors its own click, so this is duck-typed)."""

    def walk(cmd: Any, table: dict[str, Any], trail: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        subs: dict[str, Any] = getattr(cmd, "commands", {})
        params = {p.name: p for p in cmd.params if p.name and p.expose_value and p.param_type_name == "option"}
        flags = {o.lstrip("-").replace("-", "_"): p.name for p in params.values() for o in p.opts if o.startswith("--")}
        for key, value in table.items():
            name = flags.get(key.replace("-", "_"), key.replace("-", "_"))
            if key in subs and isinstance(value, dict):
                out[key] = walk(subs[key], value, f"{trail} {key}".strip())
            elif name in params:
                out[name] = value
            else:
                known = sorted([*(f.replace("_", "-") for f in flags), *subs])
                raise _invalid(
                    path,
                    f"[{trail or 'top level'}] has no setting {key!r}"
                    + (f"; known: {', '.join(known)}" if known else ""),
                )
        return out

    return walk(root, tables, "")


def prepare(explicit: Path | None) -> tuple[Path | None, Settings, dict[str, Any]]:
    """Read the file, validate and export its environment-backed settings; (file, settings, command tables).

    Run before the command modules are imported (their defaults read the environment at import)."""
    path = explicit or default_path()
    raw = read(path) if path is not None else {}
    settings = load_settings(path, raw)
    env_part, tables = split(raw)
    export(settings, env_part)
    return path, settings, tables


SETTING_DOCS = {
    "master_url": "CubeMaster URL for the client commands (else the one `cubeaccel up` started, else http://127.0.0.1:7700)",
    "api_key": "API key sent to CubeMaster (prefer `api_key_file`)",
    "api_key_file": "file holding the API key (0600); else `cubeaccel up`'s admin key",
    "sandbox_token": "a sandbox's access token for `sandbox exec` / `sandbox cp`",
    "state_dir": "the Cubelet's state directory (`cubelet serve`; where `devices` looks first)",
    "master_state_dir": "CubeMaster's state directory (`master serve`)",
    "up_state_dir": "`cubeaccel up`'s state directory (and where the client commands find its stack)",
    "cache_dir": "image and template-state cache (default `$XDG_CACHE_HOME/cubeaccel`, `~/.cache/cubeaccel`)",
    "qemu": "the qemu-system-x86_64 binary (default: the one on $PATH)",
    "accel": "force QEMU's accelerator, `kvm` or `tcg` (default: kvm where a guest runs under it)",
    "http_header_timeout_s": "seconds a connection may take to send complete request headers (default 10)",
    "http_body_timeout_s": "seconds a request body may take to arrive (default 30)",
    "http_idle_timeout_s": "seconds an idle keep-alive connection stays open (default 15)",
    "log_level": "`debug`, `info`, `warning` or `error` for the servers' JSON log lines on stderr",
}
OTHER_ENV = {
    "CUBEACCEL_CONFIG": "the config file (same as `--config`)",
    "CUBEACCEL_OUTPUT": "the output format (same as `-o`)",
    "CUBEACCEL_REQUIRE_VM": "tests only: VM tests fail instead of skipping when QEMU is missing",
    "CUBEACCEL_SANDBOX, CUBEACCEL_DEVICES": "not settings: the shim tags each VMM's environment with them",
    "CUBEACCEL_VMM_UIDS": "the shim: `START-END` uids for confined VMMs (default 1900000000-1900004095)",
    "CUBEACCEL_VMM_UID_LOCKS": "the shim: directory of the uid lease lock files (docs/security.md)",
    "CUBEACCEL_VMM_MEMLOCK": "the shim: how a confined VMM may lock memory, `auto`, `rlimit` or `cap_ipc_lock`",
    "CUBEACCEL_VMM_CONFINE_FAULT": "tests only: `wrong_uid` makes the confinement check refuse (never lets one pass)",
    "CUBEACCEL_CONSOLE_LOG_MAX_BYTES": "the shim: a guest console log's cap before it is rotated (default 1 MiB)",
    "CUBEACCEL_KEEP_FINISHED_RUNS": "Cubelet: how many finished runs' files (run dir, spec, log) are kept (default 32)",
    "NOTIFY_SOCKET": "set by systemd for `Type=notify` units: where READY=1 is sent",
    "XDG_CACHE_HOME, XDG_CONFIG_HOME": "the usual base directories for the cache and the config file",
}


def _envvar(prefix: str, name: str) -> str:
    return f"{prefix}_{name}".upper().replace("-", "_")


def reference_markdown(root: Any) -> str:
    """The settings reference in docs/config.md (generated: `python scripts/config-doc.py`; a test compares)."""
    lines = ["<!-- generated by scripts/config-doc.py from the command tree: do not edit by hand -->", ""]
    lines += ["### Top-level settings (environment-backed)", "", "| key | environment | meaning |", "|---|---|---|"]
    for name in Settings.model_fields:
        lines.append(f"| `{name}` | `{env_name(name)}` | {SETTING_DOCS[name]} |")
    lines += ["", "Other variables read:", ""]
    lines += [f"- `{k}`: {v}" for k, v in OTHER_ENV.items()]

    def walk(cmd: Any, path: list[str]) -> None:
        subs: dict[str, Any] = getattr(cmd, "commands", {})
        options = [p for p in cmd.params if p.param_type_name == "option" and p.expose_value and path]
        options = [p for p in options if p.name not in ("version",)]
        if options:
            prefix = "_".join(["CUBEACCEL", *path])
            lines.extend(["", f"### `[{'.'.join(path)}]` — `cubeaccel {' '.join(path)}`", ""])
            lines.extend(["| key | environment | default | meaning |", "|---|---|---|---|"])
            for p in options:
                flag = next((o for o in p.opts if o.startswith("--")), p.opts[0]).lstrip("-")
                default = p.default if not callable(p.default) else None
                shown = "" if default in (None, (), []) else f"`{default}`"
                if isinstance(default, Path) and str(default).startswith(str(Path.home())):
                    shown = f"`~{str(default)[len(str(Path.home())) :]}`"
                help_text = (p.help or "").replace("|", "\\|").replace("\n", " ")
                lines.append(f"| `{flag}` | `{_envvar(prefix, p.name)}` | {shown} | {help_text} |")
        for name in sorted(subs):
            walk(subs[name], [*path, name])

    walk(root, [])
    return "\n".join(lines) + "\n"
