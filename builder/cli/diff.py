"""`builder diff`: thin command over builder.lock.diff."""

from __future__ import annotations

import click

from builder import output
from builder.cli import get_ctx
from builder.lock import diff as core


@click.command()
@click.argument("old", required=False)
@click.argument("new", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the changes as JSON on stdout.")
@click.option("--exit-code", "exit_code", is_flag=True, help="Exit 1 when the locks differ (like git diff).")
def diff(old: str | None, new: str | None, as_json: bool, exit_code: bool) -> int:
    """Show what moved between two locks.

    OLD and NEW are lock files or REV:path (a git revision of a lock, e.g. HEAD~1:pins.lock).
    NEW defaults to the current lock; OLD defaults to HEAD:<the current lock>.
    """
    c = get_ctx()
    current = str(c.lock)
    old_spec = old if old is not None else f"HEAD:{current}"
    new_spec = new if new is not None else current
    changes = core.diff(old_spec, new_spec)
    if as_json:
        output.data_json({"old": old_spec, "new": new_spec, "changes": [ch.as_dict() for ch in changes]})
    elif changes:
        output.table(f"{old_spec} -> {new_spec}", ["input", "kind", "change"],
                     [[ch.input, ch.kind, ch.what] for ch in changes])
    else:
        output.status(f"{old_spec} -> {new_spec}: no changes")
    return 1 if (exit_code and changes) else 0
