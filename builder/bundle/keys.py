"""The keys a bundle is signed and verified with: where they are, and the fleet's trusted key."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from dataclasses import dataclass
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


def project_key_dir(root: Path) -> Path:
    """The project's own key folder, `keys/` (ignored by git)."""
    return root / "keys"


@dataclass(frozen=True)
class SigningKeyChoice:
    """Which secret key signs, and what named it (``--key``, ``$BUILDER_SIGNING_KEY``, the project's
    keys/, the keygen default)."""

    path: Path
    source: str


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def choose_signing_key(
    opt: Path | None, root: Path | None, *, allow_outside: bool = False, flag: str = "--key"
) -> SigningKeyChoice:
    """--key, else $BUILDER_SIGNING_KEY, else the project's keys/builder.key, else the keygen default.

    A key named explicitly (the option or the variable) is used wherever it lies. A key found by
    default outside the project (the home folder's keygen default) is refused unless ``allow_outside``:
    a bundle is never signed by a key the operator did not pick for this project."""
    if opt is not None:
        return SigningKeyChoice(opt, flag)
    env = os.environ.get(SIGNING_KEY_ENV)
    if env:
        return SigningKeyChoice(Path(env), f"${SIGNING_KEY_ENV}")
    if root is not None:
        p = project_key_dir(root) / "builder.key"
        if p.exists():
            return SigningKeyChoice(p, "the project's keys/")
    p = default_key_dir() / "builder.key"
    if p.exists():
        if root is not None and not allow_outside and not _inside(p, root):
            raise ConfigError(
                f"{p}: signing key outside the project ({root}), refused: name it with {flag} {p} "
                "or pass --allow-outside-key"
            )
        return SigningKeyChoice(p, "the keygen default")
    raise ConfigError(
        f"no signing key: pass {flag} PATH or set {SIGNING_KEY_ENV} (make one with `builder keygen`)"
    )


def signing_key_path(
    opt: Path | None, root: Path | None = None, *, allow_outside: bool = False, flag: str = "--key"
) -> Path:
    """The path of choose_signing_key; ConfigError when none exists or it is refused."""
    return choose_signing_key(opt, root, allow_outside=allow_outside, flag=flag).path


def describe_signing_key(choice: SigningKeyChoice) -> str:
    """The key that signs, named: its path, its public key id, what named it (never its content).
    Loads the key, so a malformed or too open key fails here (ConfigError)."""
    secret = sign.load_secret_key(choice.path)
    return f"{choice.path} (key id {secret.public_key.key_id_hex}, from {choice.source})"


def keygen(out_dir: Path | None, force: bool = False, root: Path | None = None) -> tuple[Path, Path, str]:
    """Write builder.key (0600) and builder.pub in out_dir (default: the project's keys/ when a root is
    given, else the keygen default); return (secret path, public path, key id). A relative out_dir is
    under the project root, wherever the command runs, as the default is; a folder that git would track
    takes the secret key only when named by an absolute path (refused_by_git)."""
    if out_dir is None:
        d = project_key_dir(root) if root is not None else default_key_dir()
    else:
        d = out_dir if out_dir.is_absolute() or root is None else root / out_dir
    sk, pk = d / "builder.key", d / "builder.pub"
    if out_dir is None or not out_dir.is_absolute():
        why = refused_by_git(sk)
        if why is not None:
            raise ConfigError(why)
    d.mkdir(parents=True, exist_ok=True)
    pub = sign.generate_keypair(sk, pk, force=force)
    return sk, pk, pub.key_id_hex


def refused_by_git(secret: Path) -> str | None:
    """Why the secret key may not be written at ``secret`` (None: it may): the folder is in a git work
    tree that would track it (not ignored, or the file tracked already), where one `git add -A` away it
    would leave with the next push. Outside a work tree, or without git, there is nothing to ask."""
    secret = secret.absolute()
    here = secret.parent
    while not here.is_dir():  # (git -C needs a folder that exists; the key's may not yet)
        here = here.parent
    try:
        p = subprocess.run(["git", "-C", str(here), "check-ignore", "-q", "--", str(secret)],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 1:  # 0: ignored; 128: not in a work tree
        return None
    return (f"{secret}: a secret key is not written into a folder git would track (its work tree does not "
            f"ignore it): add the folder to .gitignore, or name it by an absolute path (--out /ABSOLUTE/PATH)")


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
    else the project's keys/builder.pub,
    else the keygen default public key."""
    if key is not None:
        return key
    if root is not None:
        with contextlib.suppress(Exception):
            fleet_name = json.loads((bundle_dir / MANIFEST).read_bytes())["fleet"]
            p = fleet_trusted_key(root, str(fleet_name), hosts_dir)
            if p is not None:
                return p
    for d in ([project_key_dir(root)] if root is not None else []) + [default_key_dir()]:
        if (d / "builder.pub").exists():
            return d / "builder.pub"
    raise ConfigError(
        "no public key to verify with: pass --key PUB (or set fleet.trusted_key in the inventory)"
    )
