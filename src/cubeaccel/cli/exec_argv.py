"""`sandbox exec ID [OPTIONS] [--] CMD…`: where the command starts.

Click with interspersed options off (so that `ls -la` stays the command's) takes everything after the sandbox id
as the command, so `exec ID --no-stdin -- CMD` ran `--no-stdin -- CMD` in the guest. The rule here, as `kubectl exec`
reads it: exec's own options may come before or after the id; the command starts at `--`, or at the first word
after the id that is not one of exec's options. A dash word after the id that exec does not know is refused
rather than run: a mistyped option must not become the command.
"""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperCommand, TyperOption


def command_after_id(args: list[str], value_options: set[str], flag_options: set[str]) -> list[str]:
    """`args` reordered as click reads them with interspersed options off: options, the id, `--`, the command.

    `value_options` take a value (`--cwd D` or `--cwd=D`); `flag_options` do not. Raises `typer.BadParameter` for
    an unknown dash word between the id and the command."""
    options: list[str] = []
    sandbox_id: str | None = None
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            i += 1
            break
        if not word.startswith("-") or word == "-":
            if sandbox_id is not None:
                break  # the command's first word
            sandbox_id = word
            i += 1
            continue
        name = word.split("=", 1)[0]
        if name in value_options:
            take = 1 if "=" in word else 2
            options += args[i : i + take]
            i += take
        elif name in flag_options or sandbox_id is None:
            options.append(word)  # before the id an unknown one is click's to refuse, as for any command
            i += 1
        else:
            raise typer.BadParameter(f"{name!r} is no option of exec (put the command after `--`)", param_hint="CMD")
    if sandbox_id is None:
        return options + args[i:]
    return [*options, sandbox_id, "--", *args[i:]]


class ExecCommand(TyperCommand):
    """`sandbox exec`: its options are read before and after the sandbox id, up to the command."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # typer vendors click: its Context class is private
        value_options: set[str] = set()
        flag_options: set[str] = set()
        for p in self.get_params(ctx):
            if isinstance(p, TyperOption):
                names = {*p.opts, *p.secondary_opts}
                (flag_options if p.is_flag or p.count else value_options).update(names)
        out: Any = super().parse_args(ctx, command_after_id(args, value_options, flag_options))
        return list(out)
