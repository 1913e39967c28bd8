"""`builder ship`: thin command over builder.ship."""

from __future__ import annotations

from pathlib import Path

import click

from builder import output
from builder import ship as core
from builder.cli import get_ctx
from builder.cli.options import (
    allow_outside_key_option,
    file_option,
    folder_option,
    hosts_dir_option,
    insecure_option,
    json_option,
)


@click.command()
@click.argument("host")
@folder_option("--to", "to", help="Copy the bundle to DIR/<fleet>/<host>/ (sneakernet) instead of installing over SSH.")
@folder_option("--bundle", "bundle_dir", help="The bundle folder [default: out/bundles/<fleet>/<host>].")
@file_option("--key", "key", help="Public key the host trusts [default: fleet.trusted_key, else the signing key's].")
@file_option("--signing-key", "signing_key",
             help="Signing key whose public half to trust when no public key is configured.")
@allow_outside_key_option
@click.option("--timeout", "timeout", type=float, default=60.0, show_default=True,
              help="Base seconds for every remote call (transfers add size / 1 MiB/s).")
@insecure_option
@json_option()
@hosts_dir_option
def ship(
    host: str,
    to: Path | None,
    bundle_dir: Path | None,
    key: Path | None,
    signing_key: Path | None,
    allow_outside_key: bool,
    timeout: float,
    insecure: bool,
    as_json: bool,
    hosts_dir: Path | None,
) -> int:
    """Copy HOST's bundle to it over SSH (resuming) and install it; or copy it to a folder with --to."""
    c = get_ctx()
    opts = core.ShipOptions(
        bundle=bundle_dir, hosts_dir=hosts_dir, to=to, key=key, signing_key=signing_key,
        allow_outside_key=allow_outside_key, timeout=timeout, insecure=insecure,
    )
    with output.progress() as bar:
        total = bar.add_task(f"ship {host}", total=None)
        current = bar.add_task("", total=None, visible=False)
        sizes: dict[str, int] = {}
        last = [""]

        def on_plan(plan: list[tuple[str, int]]) -> None:
            sizes.update(plan)
            bar.update(total, total=sum(sizes.values()))

        def on_bytes(path: str, n: int) -> None:
            if last[0] != path:  # a new file: its own bar
                last[0] = path
                bar.reset(current, total=sizes.get(path), description=f"  {path}", visible=True)
            bar.advance(total, n)
            bar.advance(current, n)

        opts.on_plan, opts.on_bytes = on_plan, on_bytes
        r = core.ship(c.root, host, opts)
    if as_json:
        output.data_json(
            {
                "host": r.host,
                "fleet": r.fleet,
                "bundle_id": r.bundle_id,
                "result": r.result,
                "sent": r.sent,
                "skipped": r.skipped,
                "removed": r.removed,
                "dest": r.dest,
                "bytes_sent": r.bytes_sent,
                "bytes_pulled": r.bytes_pulled,
                "pull_seconds": r.pull_seconds,
            }
        )
    if r.result == "copied":
        output.status(
            f"{r.host}: bundle {r.bundle_id[:16]} copied to {r.dest} ({len(r.sent)} sent, "
            f"{len(r.skipped)} already there); on the host, with a trusted installer: "
            f"python3 install.pyz install {r.dest} --root <paths.bundles>"
        )
    elif r.result == "unchanged":
        output.status(f"{r.host}: bundle {r.bundle_id[:16]} is already installed; nothing sent")
    else:
        pulled = ""
        if r.bytes_pulled:
            rate = r.bytes_pulled / (1 << 20) / max(r.pull_seconds, 1e-6)
            pulled = f"; {r.bytes_pulled / (1 << 30):.2f} GiB pulled from the fleet registry at {rate:.0f} MiB/s"
        output.status(
            f"{r.host}: bundle {r.bundle_id[:16]} {r.result} ({len(r.sent)} files sent, "
            f"{len(r.skipped)} already there{pulled})"
        )
    return 0
