"""`builder keygen`, `builder bundle`, `builder verify`: thin commands over builder.bundle."""

from __future__ import annotations

from pathlib import Path

import click

from builder import bundle as core
from builder import output
from builder.bundle.thin import read_have
from builder.cli import get_ctx
from builder.cli.options import (
    allow_outside_key_option,
    file_option,
    fleet_option,
    folder_option,
    hosts_dir_option,
    json_option,
    part_size_option,
)
from builder.errors import ConfigError


@click.command()
@folder_option("--out", "out", help="Folder for builder.key and builder.pub [default: keys/ under the project root; "
               "a relative path is under the project root too]. Refused where git would track the key, "
               "unless given as an absolute path.")
@click.option("--force", is_flag=True, help="Replace an existing key pair.")
@json_option()
def keygen(out: Path | None, force: bool, as_json: bool) -> int:
    """Make an Ed25519 key pair (minisign-compatible): builder.key (mode 0600) and builder.pub."""
    sk, pk, key_id = core.keygen(out, force=force, root=get_ctx().root)
    if as_json:
        output.data_json({"secret_key": str(sk), "public_key": str(pk), "key_id": key_id})
    output.status(f"wrote {sk} (secret, 0600) and {pk} (public), key id {key_id}")
    output.status("give the fleet its public key (fleet.trusted_key); keep the secret key off the hosts")
    return 0


@click.command()
@click.argument("host", required=False)
@fleet_option("Bundle every host of this fleet.")
@folder_option("--out", "out", help="Output folder [default: out/bundles/<fleet>/<host>; with --fleet, the parent].")
@file_option("--key", "key", help="Signing key [default: $BUILDER_SIGNING_KEY, else keys/builder.key under the "
             "project root].")
@allow_outside_key_option
@click.option("--with-image", is_flag=True, help="Include the image as a docker-load archive (image.tar).")
@click.option("--with-models", is_flag=True, help="Include this rank's model files (models/).")
@click.option("--thin", is_flag=True, help="With --with-image: leave out the layers the host holds (--have).")
@click.option("--have", "have", type=click.Path(dir_okay=False, path_type=Path),
              help="The host's layer list: its apply record or `installer status` JSON (for --thin).")
@part_size_option
@json_option()
@hosts_dir_option
def bundle(
    host: str | None,
    fleet: str | None,
    out: Path | None,
    key: Path | None,
    allow_outside_key: bool,
    with_image: bool,
    with_models: bool,
    thin: bool,
    have: Path | None,
    part_size: str,
    as_json: bool,
    hosts_dir: Path | None,
) -> int:
    """Render a signed, deterministic launch bundle for HOST (or every host of --fleet)."""
    if (host is None) == (fleet is None):
        raise ConfigError("give a HOST or --fleet NAME (one of them)")
    c = get_ctx()
    if thin != (have is not None) or (thin and not with_image):
        raise ConfigError("--thin needs --with-image and --have FILE (the host's layer list)")

    opts = core.BundleOptions(
        out=out, key=key, allow_outside_key=allow_outside_key, with_image=with_image, with_models=with_models,
        part_size=core.parse_size(part_size),
        have=read_have(have) if have is not None else None,
    )
    ctx = core.load_bundle_inputs(c.pins, c.lock, c.store, hosts_dir)
    with output.progress() as bar:
        opts.progress = lambda name, total: output.byte_counter(bar, f"bundle {name}", total)
        results = core.make_fleet_bundles(ctx, fleet, opts) if fleet else [core.make_bundle(ctx, str(host), opts)]
    for r in results:
        note = " (unchanged)" if r.unchanged else ""
        output.status(
            f"{r.fleet}/{r.host} (rank {r.rank}): {r.path}: bundle {r.bundle_id[:16]}, {r.files} files, "
            f"{r.size} bytes, {r.parts} parts{note}"
        )
    # (the same choice each bundle was signed by: a key refused or unreadable failed before any write)
    signer = core.choose_signing_key(key, c.root, allow_outside=allow_outside_key)
    output.status(f"signed with {core.describe_signing_key(signer)}")
    if as_json:
        output.data_json(
            [
                {
                    "fleet": r.fleet,
                    "host": r.host,
                    "rank": r.rank,
                    "path": str(r.path),
                    "bundle_id": r.bundle_id,
                    "files": r.files,
                    "size": r.size,
                    "parts": r.parts,
                    "unchanged": r.unchanged,
                }
                for r in results
            ]
        )
    return 0


@click.command()
@click.argument("bundle_dir", type=click.Path(file_okay=False, path_type=Path))
@file_option("--key", "key", help="Public key [default: the fleet's trusted_key, else keys/builder.pub under the "
             "project root, else the keygen default].")
@json_option()
@hosts_dir_option
def verify(bundle_dir: Path, key: Path | None, as_json: bool, hosts_dir: Path | None) -> int:
    """Check a bundle folder: the signature, then every file's hash (extra, missing, changed: exit 1)."""
    c = get_ctx()
    pub = core.public_key_for(bundle_dir, key, c.root, hosts_dir)
    total = sum(p.stat().st_size for p in bundle_dir.rglob("*") if p.is_file()) if bundle_dir.is_dir() else 0
    with output.progress() as bar:
        m = core.verify_dir(bundle_dir, pub, output.byte_counter(bar, f"verify {bundle_dir.name}", total))
    if as_json:
        output.data_json(
            {
                "ok": True,
                "bundle_id": m["bundle_id"],
                "fleet": m["fleet"],
                "host": m["host"],
                "lane": m["lane"],
                "rank": m["rank"],
                "files": len(m["files"]),
            }
        )
    output.status(
        f"{bundle_dir}: OK: bundle {m['bundle_id'][:16]} for {m['fleet']}/{m['host']} "
        f"(lane {m['lane']}, rank {m['rank']}), {len(m['files'])} files verified"
    )
    return 0
