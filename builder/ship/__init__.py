"""Move a bundle to its host and install it: over SSH (resumable), or to a folder for sneakernet.

The rooms: `job` (what a ship is asked and what it did), `remote` (running commands on a host
over its one connection), `send` (the stream to the installer's ``receive``), `todir` (the
sneakernet copy); here: checking the bundle and picking the way.

Over SSH (builder.foundation.ssh: the system ``ssh`` with the fleet's ssh_config when it names one,
``BatchMode=yes``, a connect timeout and keep-alives, and one connection per host for the whole ship,
however many files are sent; host keys are checked as ssh_config says, never switched off):

1. the bundle's signature, manifest and file sizes are checked here (its bytes were hashed when
   they were written; the host hashes every byte it receives);
2. one remote command keeps this machine's trusted installer on the host as
   ``<paths.bundles>/incoming/install-<sha256[:16]>.pyz`` (builder.store.placement.kept_installer; sent at
   the head of the stream, written only
   when the host's copy is missing or differs, checked against that sha256 before it runs) and runs
   its ``receive``: it gets the signed manifest first, says when the bundle is already installed
   (or staged, for ``--stage``: nothing is sent), else which files it lacks and from which byte (what
   a cut ship left is not sent again), then reads exactly those bytes from the same stdin (sent
   with sendfile, no per-file command; the image archive first, so docker load runs while the model
   files arrive), hashes each as it arrives into the file it ends up in (a model file beside its
   place, the image archive and launch files in ``incoming/``), refuses a wrong byte naming the
   file, and installs: load, place, stage (the release links the launch files received), switch,
   record.

Every ssh call has a timeout (base + size / minimum rate). A host that cannot be reached (ssh exit
255, or no answer in time) gives UnreachableError (exit 3, one line naming the host); a rerun resumes.

``--to DIR`` copies the bundle to ``DIR/<fleet>/<host>/`` instead (resumable the same way), then
verifies the copy. Install it on the host with a trusted installer (install.pyz, see
builder/installer/__init__.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from builder.bundle import public_key_for, read_public_key, signing_key_path, verify_with_key
from builder.errors import ConfigError, VerifyError
from builder.foundation import sign
from builder.inputs.hosts import Fleet, Host, bundles_folder, find_host, hosts_folder
from builder.installer.errors import InstallError
from builder.installer.manifest import MANIFEST
from builder.installer.verify import verify_bundle
from builder.ship.job import ShipOptions, ShipResult
from builder.ship.remote import Remote
from builder.ship.send import ship_over_ssh
from builder.ship.todir import ship_to_dir

__all__ = ["Remote", "ShipOptions", "ShipResult", "ship", "ship_to_dir", "trusted_key_bytes"]


def ship(root: Path, host_ref: str, opts: ShipOptions) -> ShipResult:
    """Ship HOST's bundle (project root = the folder of pins.toml; inventories in opts.hosts_dir, else
    root/hosts)."""
    fleet_file, fleet, host = find_host(hosts_folder(root, opts.hosts_dir), host_ref)
    bdir, manifest, key = _load_bundle(root, fleet, host, opts)
    if opts.to is not None:
        return ship_to_dir(
            bdir, manifest, opts.to / fleet.fleet.name / host.name, key if not opts.insecure else None
        )
    with Remote(fleet_file, fleet, host, opts.connect_timeout, sockets=opts.sockets) as remote:
        return ship_over_ssh(remote, host, bdir, manifest, key, opts)


def trusted_key_bytes(root: Path, fleet: Fleet, bundle_dir: Path, opts: ShipOptions) -> bytes:
    """The public key the host is told to trust: --key, else fleet.trusted_key, else the signing key's."""
    if opts.key is not None or fleet.fleet.trusted_key:
        return read_public_key(public_key_for(bundle_dir, opts.key, root, opts.hosts_dir))
    sk = sign.load_secret_key(
        signing_key_path(opts.signing_key, root, allow_outside=opts.allow_outside_key, flag="--signing-key")
    )
    return sign.public_key_text(sk.public_key).encode("ascii")


def _load_bundle(
    root: Path, fleet: Fleet, host: Host, opts: ShipOptions
) -> tuple[Path, dict[str, Any], bytes]:
    bdir = opts.bundle or bundles_folder(root, fleet.fleet.name, host.name)
    if not (bdir / MANIFEST).is_file():
        raise ConfigError(f"{bdir}: no bundle there (run `builder bundle {host.name}`)")
    # Over ssh the host hashes every byte it receives against the signed manifest (and refuses a
    # wrong one, naming the file), so here the signature and sizes suffice; a copy to a folder is
    # checked in full here, as nothing else will check it before it is carried away.
    hashes = opts.to is not None
    if opts.insecure:  # nothing is checked against a key, so none is needed (or asked for)
        key = b""
        try:
            manifest, _, _ = verify_bundle(str(bdir), None, insecure=True, hashes=hashes)
        except InstallError as e:
            raise VerifyError(str(e)) from None
    else:
        key = trusted_key_bytes(root, fleet, bdir, opts)
        manifest = verify_with_key(bdir, key, hashes=hashes)
    if manifest["host"] != host.name or manifest["fleet"] != fleet.fleet.name:
        raise ConfigError(
            f"{bdir}: the bundle is for {manifest['fleet']}/{manifest['host']}, not "
            f"{fleet.fleet.name}/{host.name}"
        )
    return bdir, manifest, key
