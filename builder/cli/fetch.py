"""`builder fetch`: thin command over builder.store.modelfetch."""

from __future__ import annotations

import click

from builder import output
from builder.cli import get_ctx
from builder.inputs.pins import load_pins
from builder.lock.lockfile import load_lock
from builder.store import modelfetch as core
from builder.store.modelstore import Wanted


@click.command()
@click.argument("names", nargs=-1)
@click.option("--offline", is_flag=True, help="Fetch nothing: import local copies, list what is missing (exit 1).")
@click.option("--jobs", type=click.IntRange(1, 64), default=4, show_default=True, help="Files at once.")
@click.option("--verify", is_flag=True, help="Hash the files already in the store again (a store changed behind "
              "builder's back is named and fetched again).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def fetch(names: tuple[str, ...], offline: bool, jobs: int, verify: bool, as_json: bool) -> int:
    """Put the locked files hosts get (model files, kit files, runtime plain files) of the named lanes,
    models, kits or files (default: every lane's) into the store."""
    c = get_ctx()
    pins, lock = load_pins(c.pins), load_lock(c.lock)
    total = core.bytes_to_bring(pins, lock, c.root, c.store, list(names), verify=verify)
    with output.progress() as bar:
        work = output.InFlight(bar, "fetch", total)

        class Shown:
            """The files in flight by name on the bar (``get tiny/model.safetensors +3``), bytes as they come."""

            def __init__(self) -> None:
                self.keys: dict[tuple[str, str, str], int] = {}

            def start(self, w: Wanted, verb: str) -> None:
                self.keys[(w.kind, w.model, w.path)] = work.start(f"{verb} {w.model}/{w.path}")

            def advance(self, n: int) -> None:
                work.advance(n)

            def finish(self, w: Wanted) -> None:
                key = self.keys.pop((w.kind, w.model, w.path), None)
                if key is not None:
                    work.finish(key)

        rep = core.fetch(pins, lock, c.root, c.store, list(names), offline=offline, jobs=jobs, verify=verify,
                         progress=Shown())
    if as_json:
        output.data_json(rep.to_json())
    for _, why in rep.repaired:
        output.warn(why)
    for w in rep.missing:
        output.error(f"{w.where}: not in the store and --offline was given")
    for _, why in rep.failed:
        output.error(why)
    output.status(
        f"{len(rep.present)} present, {len(rep.imported)} imported, {len(rep.downloaded)} downloaded, "
        f"{len(rep.missing)} missing, {len(rep.failed)} failed"
    )
    return 1 if rep.missing or rep.failed else 0
