"""`builder image`, `builder why`, `builder gc`: thin commands over builder.image.build and builder.store.content."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from builder import output
from builder.cli import get_ctx
from builder.cli.push import target_from
from builder.image import build as core
from builder.image import registry
from builder.image.gc import collect
from builder.image.plan import plan
from builder.inputs.hosts import hosts_folder
from builder.inputs.pins import load_pins
from builder.lock.lockfile import load_lock


@click.command()
@click.argument("name")
@click.option("--plan", "plan_only", is_flag=True, help="Print the closure and input address; build nothing.")
@click.option("--check-reproducible", is_flag=True, help="Rebuild from nothing and compare ImageIDs.")
@click.option("--offline", is_flag=True, help="Use the store and local files only.")
@click.option("--force", is_flag=True, help="Build even when the tagged image is up to date.")
@click.option("--no-cache", "nocache", is_flag=True,
              help="Build every step again and leave no build cache (a host short of disk).")
@click.option("--emulate", is_flag=True, help="Allow building another platform than the engine's (QEMU).")
@click.option("--json", "as_json", is_flag=True, help="Print the result record as JSON on stdout.")
@click.option("--push", "push_to", metavar="URL", help="Then push it to this registry by digest (builder push).")
@click.option("--ca", "ca", type=click.Path(dir_okay=False), help="CA file of the --push registry's TLS.")
def image(name: str, plan_only: bool, check_reproducible: bool, offline: bool, force: bool, nocache: bool,
          emulate: bool, as_json: bool, push_to: str | None, ca: str | None) -> int:
    """Build the locked closure of image NAME into a content-addressed, reproducible image."""
    c = get_ctx()
    target = None
    if push_to is not None:  # a bad URL is refused before anything is built
        target = target_from(push_to, Path(ca) if ca else None, None, hosts_folder(c.root))
    if plan_only:
        p = plan(c.pins, c.lock, name)
        _print_plan(core.describe(p), as_json)
        return 0

    def log(line: str) -> None:
        if line.strip():
            output.detail(line)

    if check_reproducible:
        res = core.check_reproducible(c.pins, c.lock, c.store, name, offline=offline, on_log=log)
    else:
        res = core.build(c.pins, c.lock, c.store, name, offline=offline, force=force, nocache=nocache,
                         allow_emulation=emulate, on_log=log)
    rec = res.record
    if as_json:
        d = rec.model_dump(mode="json")
        d["built"] = res.built
        if res.reproducible is not None:
            d["reproducible"] = res.reproducible
        output.data_json(d)
    else:
        output.data(rec.tag)
    if rec.published is not None:
        output.status(f"{rec.tag}: {'pulled' if res.built else 'up to date'}: published {rec.published} "
                      f"({rec.image_id[:19]}, {len(rec.diff_ids)} layers)")
    elif not res.built:
        output.status(f"{rec.tag}: up to date ({rec.image_id[:19]})")
    else:
        output.status(f"{rec.tag}: built {rec.image_id[:19]} ({len(rec.diff_ids)} layers)")
    if res.reproducible:
        output.status(f"{rec.tag}: reproducible: a rebuild from nothing gave the same ImageID {rec.image_id[:19]}")
    if target is not None:
        assert isinstance(target, registry.Target)
        with output.progress() as bar:
            pushed, _ = registry.push(c.store, rec, target,
                                      progress=lambda label, total: output.byte_counter(bar, label, total))
        output.status(f"{pushed.reference}: " + ("already in the registry; nothing sent" if pushed.already else
                      f"pushed ({pushed.sent_blobs} blobs, {pushed.sent_bytes} bytes sent)"))
    return 0


def kept_locks() -> list[Path]:
    """The older locks whose entries `builder gc` keeps too: BUILDER_KEEP_LOCKS, os.pathsep between them
    (as builder.image.gc.collect reads it)."""
    return [Path(x) for x in os.environ.get("BUILDER_KEEP_LOCKS", "").split(os.pathsep) if x]


def _print_plan(d: dict[str, object], as_json: bool) -> None:
    if as_json:
        output.data_json(d)
        return
    output.data(f"{d['image']} {d['input_address']}")
    output.data(json.dumps(d["closure"], indent=2, sort_keys=True))


@click.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON on stdout.")
def why(name: str, as_json: bool) -> int:
    """Print image NAME's closure (what goes in) and its input address, without building."""
    c = get_ctx()

    _print_plan(core.describe(plan(c.pins, c.lock, name)), as_json)
    return 0


@click.command()
@click.option("--dry-run", is_flag=True, help="Say what would be removed.")
@click.option("--verify", is_flag=True, help="Also remove entries whose bytes no longer match their hash.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def gc(dry_run: bool, verify: bool, as_json: bool) -> int:
    """Remove store entries that no lock refers to (the current lock, plus locks given in BUILDER_KEEP_LOCKS)."""
    c = get_ctx()
    # gc keeps what the pins and the locks name, so a file it cannot read would name nothing and let it
    # delete what is in use: each is read (a problem is exit 2, one line) before anything is removed
    load_pins(c.pins)
    for lock in (c.lock, *kept_locks()):
        load_lock(lock)
    rep = collect(c.pins, c.lock, c.store, dry_run=dry_run, verify=verify)
    if as_json:
        output.data_json({"removed": rep.removed, "kept": rep.kept, "freed_bytes": rep.freed_bytes,
                          "dry_run": dry_run})
    else:
        for r in rep.removed:
            output.data(r)
    output.status(f"{'would remove' if dry_run else 'removed'} {len(rep.removed)}, kept {rep.kept}, "
                  f"{rep.freed_bytes} bytes")
    return 0
