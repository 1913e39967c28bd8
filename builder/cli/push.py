"""`builder push NAME`: the built image into a registry by digest (builder.image.registry)."""

from __future__ import annotations

from pathlib import Path

import click

from builder import output
from builder.cli import get_ctx
from builder.cli.options import hosts_dir_option
from builder.errors import ConfigError
from builder.image import registry as reg
from builder.image.imagerecord import require_record
from builder.image.plan import plan
from builder.inputs.hosts import find_fleet, fleet_registry_ca, hosts_folder


def target_from(registry: str | None, ca: Path | None, fleet: str | None, hosts_dir: Path) -> reg.Target:
    """The registry to push to: ``--registry URL`` (with ``--ca``), or the fleet's ``fleet.registry``."""
    if (registry is None) == (fleet is None):
        raise ConfigError("builder push: give --registry URL or --fleet NAME (one of them)")
    if registry is not None:
        return reg.parse_target(registry, "--registry", ca)
    assert fleet is not None
    path, f = find_fleet(hosts_dir, fleet)
    if f.fleet.registry is None:
        raise ConfigError(f"{path}: fleet.registry: not set (the fleet takes its image from bundles)")
    return reg.parse_target(f.fleet.registry, f"{path}: fleet.registry", ca or fleet_registry_ca(path, f))


def push_image(name: str, target: reg.Target, as_json: bool) -> int:
    c = get_ctx()
    address = plan(c.pins, c.lock, name).address  # a stale lock is refused here, before any request
    rec = require_record(c.store, name, address)

    with output.progress() as bar:
        res, _ = reg.push(c.store, rec, target, on_log=output.detail,
                          progress=lambda label, total: output.byte_counter(bar, label, total))
    if as_json:
        output.data_json(res.as_json())
    else:
        output.data(res.reference)
    if res.already:
        output.status(f"{res.reference}: already in {res.registry}; nothing sent")
    else:
        output.status(f"{res.reference}: pushed ({res.sent_blobs} blobs, {res.sent_bytes} bytes sent; "
                      f"{res.held_blobs} held already)")
    return 0


@click.command()
@click.argument("name")
@click.option("--registry", "registry", metavar="URL", help="https://host:port (http:// for loopback only).")
@click.option("--ca", "ca", type=click.Path(dir_okay=False, path_type=Path), help="CA file of the registry's TLS.")
@click.option("--fleet", "fleet", metavar="NAME", help="Push to the fleet's fleet.registry (with its CA file).")
@click.option("--json", "as_json", is_flag=True, help="Print what was pushed as JSON on stdout.")
@hosts_dir_option
def push(
    name: str, registry: str | None, ca: Path | None, fleet: str | None, as_json: bool, hosts_dir: Path | None
) -> int:
    """Push built image NAME to a registry by digest; blobs the registry holds are not sent.

    Credentials: BUILDER_REGISTRY_USER / BUILDER_REGISTRY_PASSWORD, else the docker config's auths.
    """
    c = get_ctx()
    target = target_from(registry, ca, fleet, hosts_folder(c.root, hosts_dir))
    return push_image(name, target, as_json)
