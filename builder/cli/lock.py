"""`builder lock`: thin command over builder.lock.resolve (and builder.lock.lockfile for --check)."""

from __future__ import annotations

import threading

import click

from builder import output
from builder.cli import get_ctx
from builder.errors import named
from builder.lock import resolve as core
from builder.lock.unknown import check


@click.command()
@click.argument("names", nargs=-1)
@click.option("--offline", is_flag=True, help="Use caches and local files only; name every input not reachable.")
@click.option("--update", "update", multiple=True, metavar="NAME", help="Re-resolve this input (repeatable).")
@click.option("--check", "check_only", is_flag=True,
              help="Exit 1 if the lock is stale, incomplete or malformed (no network).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def lock(names: tuple[str, ...], offline: bool, update: tuple[str, ...], check_only: bool, as_json: bool) -> int:
    """Resolve every input of pins.toml (or of the named lanes/images/inputs) into the lock.

    Inputs whose pin did not change keep their locked entry; --update NAME re-resolves one.
    """
    c = get_ctx()
    if check_only:
        res = check(c.pins, c.lock, list(names) or None)
        if as_json:
            output.data_json({"ok": res.ok, "problems": res.problems,
                              "unknown": [{"input": k, "what": v} for k, v in res.unknown.items()]})
        for p in res.problems:
            if p.split(":", 1)[0] not in res.unknown:
                output.error(f"{c.lock}: stale: {p}")
        if res.unknown:
            _say_unknown(str(c.lock), res.unknown, res.complete_lanes)
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
    for what, old, new in rep.moved if rep.written else []:  # (a lock that failed moved nothing)
        output.status(f"{what}: {old} -> {new}")
    if as_json:
        output.data_json({"lock": str(rep.lock_path), "written": rep.written, "resolved": rep.resolved,
                          "kept": rep.kept, "failed": rep.failed,
                          "moved": [{"input": a, "old": b, "new": n} for a, b, n in rep.moved]})
    for name, why in sorted(rep.failed.items()):
        output.error(named(name, why))
    output.status(f"{rep.lock_path}: {len(rep.resolved)} resolved, {len(rep.kept)} kept, "
                  f"{len(rep.failed)} failed" + ("" if rep.written else " (unchanged)"))
    return 1 if rep.failed else 0


def _say_unknown(lock: str, unknown: dict[str, str], complete: list[str]) -> None:
    output.status(f"{lock}: {len(unknown)} input(s) are not in the lock because their hashes are UNKNOWN: "
                  "their pins give none (nobody has published one), so only their sources can, and builder "
                  "guesses none:")
    for name, what in unknown.items():
        output.detail(f"{name}: {what}")
    lanes = f"; the lanes with every input known: {', '.join(complete)} (`builder lock --check {complete[0]}`)" \
        if complete else ""
    output.error(f"{lock}: incomplete: {len(unknown)} input(s) UNKNOWN (above); `builder lock NAME` on a machine "
                 f"that reaches their sources resolves and records them{lanes}")
