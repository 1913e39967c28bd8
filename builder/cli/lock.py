"""`builder lock`: thin command over builder.lock.resolve (and builder.lock.lockfile for --check)."""

from __future__ import annotations

import threading

import click

from builder import output
from builder.cli import get_ctx
from builder.lock import resolve as core
from builder.lock.lockfile import check_lock


@click.command()
@click.argument("names", nargs=-1)
@click.option("--offline", is_flag=True, help="Use caches and local files only; name every input not reachable.")
@click.option("--update", "update", multiple=True, metavar="NAME", help="Re-resolve this input (repeatable).")
@click.option("--check", "check", is_flag=True,
              help="Exit 1 if the lock is stale, incomplete or malformed (no network).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def lock(names: tuple[str, ...], offline: bool, update: tuple[str, ...], check: bool, as_json: bool) -> int:
    """Resolve every input of pins.toml (or of the named lanes/images/inputs) into the lock.

    Inputs whose pin did not change keep their locked entry; --update NAME re-resolves one.
    """
    c = get_ctx()
    if check:
        res = check_lock(c.pins, c.lock, list(names) or None)
        if as_json:
            output.data_json({"ok": res.ok, "problems": res.problems})
        for p in res.problems:
            output.error(f"{c.lock}: stale: {p}")
        if res.ok:
            output.status(f"{c.lock}: up to date" + (f" for {', '.join(names)}" if names else ""))
        return 0 if res.ok else 1

    opts = core.ResolveOptions(offline=offline, update=set(update), names=list(names) or None, cache=c.store)
    with output.progress() as bar:
        tasks: dict[str, int] = {}
        new_task = threading.Lock()

        def on_hash(model: str, total: int, n: int) -> None:
            if model not in tasks:
                with new_task:
                    if model not in tasks:
                        tasks[model] = bar.add_task(f"hash {model}", total=total)
            if n:
                bar.advance(tasks[model], n)

        opts.on_hash = on_hash
        rep = core.resolve(c.pins, c.lock, opts)
    for what, old, new in rep.moved:
        output.status(f"{what}: {old} -> {new}")
    if as_json:
        output.data_json({"lock": str(rep.lock_path), "written": rep.written, "resolved": rep.resolved,
                          "kept": rep.kept, "failed": rep.failed,
                          "moved": [{"input": a, "old": b, "new": n} for a, b, n in rep.moved]})
    for name, why in sorted(rep.failed.items()):
        output.error(why if why.startswith(f"{name}:") else f"{name}: {why}")
    output.status(f"{rep.lock_path}: {len(rep.resolved)} resolved, {len(rep.kept)} kept, "
                  f"{len(rep.failed)} failed" + ("" if rep.written else " (unchanged)"))
    return 1 if rep.failed else 0
