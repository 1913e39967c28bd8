"""The keys a bundle is signed and verified with: where they are, and the fleet's trusted key."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from builder.errors import ConfigError
from builder.foundation import sign
from builder.inputs.hosts import find_fleet, hosts_folder
from builder.inputs.hosts import fleet_trusted_key as trusted_key_file
from builder.installer.manifest import MANIFEST

SIGNING_KEY_ENV = "BUILDER_SIGNING_KEY"


def default_key_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "builder"


def signing_key_path(opt: Path | None) -> Path:
    """--key, else $BUILDER_SIGNING_KEY (a path), else the keygen default; ConfigError when none exists."""
    if opt is not None:
        return opt
    env = os.environ.get(SIGNING_KEY_ENV)
    if env:
        return Path(env)
    p = default_key_dir() / "builder.key"
    if p.exists():
        return p
    raise ConfigError(
        f"no signing key: pass --key PATH or set {SIGNING_KEY_ENV} (make one with `builder keygen`)"
    )


def keygen(out_dir: Path | None, force: bool = False) -> tuple[Path, Path, str]:
    """Write builder.key (0600) and builder.pub in out_dir; return (secret path, public path, key id)."""
    d = out_dir if out_dir is not None else default_key_dir()
    d.mkdir(parents=True, exist_ok=True)
    sk, pk = d / "builder.key", d / "builder.pub"
    pub = sign.generate_keypair(sk, pk, force=force)
    return sk, pk, pub.key_id_hex


def read_public_key(path: Path) -> bytes:
    try:
        data = path.read_bytes()[: 64 * 1024]
    except FileNotFoundError:
        raise ConfigError(f"{path}: public key file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read public key: {e.strerror}") from None
    sign.load_public_key(path)  # malformed -> ConfigError
    return data


def fleet_trusted_key(root: Path, fleet_name: str, hosts_dir: Path | None = None) -> Path | None:
    """The fleet's trusted_key (relative to its fleet file's folder) when the inventory names one."""
    hosts_dir = hosts_folder(root, hosts_dir)
    if not hosts_dir.is_dir():
        return None
    try:
        path, fleet = find_fleet(hosts_dir, fleet_name)
    except ConfigError:
        return None
    return trusted_key_file(path, fleet)


def public_key_for(bundle_dir: Path, key: Path | None, root: Path | None, hosts_dir: Path | None = None) -> Path:
    """--key, else the fleet's trusted_key (from the inventory: `hosts_dir`, else hosts/ under `root`),
    else the keygen default public key."""
    if key is not None:
        return key
    if root is not None:
        with contextlib.suppress(Exception):
            fleet_name = json.loads((bundle_dir / MANIFEST).read_bytes())["fleet"]
            p = fleet_trusted_key(root, str(fleet_name), hosts_dir)
            if p is not None:
                return p
    p = default_key_dir() / "builder.pub"
    if p.exists():
        return p
    raise ConfigError(
        "no public key to verify with: pass --key PUB (or set fleet.trusted_key in the inventory)"
    )
