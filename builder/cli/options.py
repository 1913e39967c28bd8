"""The click options several commands share, each defined once (its type, default and help)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def together(*decorators: Callable[[Any], Any]) -> Callable[[F], F]:
    """Several options as one decorator, in the order written (the first is the first in --help)."""

    def apply(f: F) -> F:
        for d in reversed(decorators):
            f = d(f)
        return f

    return apply


def file_option(*decls: str, help: str, default: str | None = None, **kw: Any) -> Callable[[F], F]:
    """A path to a file (not a folder)."""
    return click.option(*decls, type=click.Path(dir_okay=False, path_type=Path), default=default, help=help, **kw)


def folder_option(*decls: str, help: str, **kw: Any) -> Callable[[F], F]:
    """A path to a folder (not a file), default None."""
    return click.option(*decls, type=click.Path(file_okay=False, path_type=Path), default=None, help=help, **kw)


def choice_option(*decls: str, choices: list[str], default: str, help: str) -> Callable[[F], F]:
    return click.option(*decls, type=click.Choice(choices), default=default, show_default=True, help=help)


def json_option(help: str = "Print the result as JSON on stdout.") -> Callable[[F], F]:
    return click.option("--json", "as_json", is_flag=True, help=help)


def fleet_option(help: str, **kw: Any) -> Callable[[F], F]:
    return click.option("--fleet", "fleet", metavar="NAME", help=help, **kw)


def ssh_persist_option(help: str) -> Callable[[F], F]:
    """--ssh-persist SECONDS: how long each host's connection stays open after the command."""
    return click.option(
        "--ssh-persist", type=click.FloatRange(min=0), default=0.0, show_default=True, metavar="SECONDS", help=help
    )


def mode_option(help: str) -> Callable[[F], F]:
    """--mode fast|full: how an audit checks the model files."""
    return choice_option("--mode", "mode", choices=["fast", "full"], default="fast", help=help)


hosts_dir_option = folder_option("--hosts-dir", help="The inventory folder [default: hosts/ under the project root].")
checks_option = folder_option(
    "--checks", "checks_dir", help="The check modules [default: checks/ under the project root]."
)
insecure_option = click.option(
    "--insecure", is_flag=True, help="Install without checking the signature (explicit only)."
)
part_size_option = click.option(
    "--part-size", "part_size", default="256MiB", show_default=True,
    help="Files larger than this are stored in hashed parts.",
)
allow_outside_key_option = click.option(
    "--allow-outside-key", is_flag=True,
    help="Sign with the keygen default key though it lies outside the project (it is refused otherwise).",
)
