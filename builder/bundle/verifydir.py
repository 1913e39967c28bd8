"""Verifying a bundle folder: the signature, then every file's hash (the installer's own rules)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from builder.bundle.keys import read_public_key
from builder.errors import ConfigError, VerifyError
from builder.foundation import sign
from builder.image import provenance
from builder.installer.errors import EXIT_CONFIG, InstallError
from builder.installer.manifest import SIGNATURE
from builder.installer.verify import verify_bundle


def crypto_sig_check(mbytes: bytes, sbytes: bytes, kbytes: bytes) -> str:
    """The installer's signature check done with builder.foundation.sign (cryptography) instead of openssl."""
    return sign.verify(mbytes, sbytes, kbytes, source=SIGNATURE)


def verify_dir(
    bundle_dir: Path, key_path: Path, on_bytes: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Signature, then every hash. VerifyError (exit 1) naming what is wrong; returns the manifest.
    ``on_bytes``: progress, told the bytes of each read as the files are hashed (from several threads)."""
    return verify_with_key(bundle_dir, read_public_key(key_path), on_bytes=on_bytes)


def verify_with_key(
    bundle_dir: Path, kbytes: bytes, *, hashes: bool = True, on_bytes: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """As verify_dir, with the public key's text. ``hashes=False``: the signature, the manifest and
    every file's presence and size only (ship: the host hashes every byte it receives)."""
    try:
        manifest, _, _ = verify_bundle(str(bundle_dir), kbytes, sig_check=crypto_sig_check, hashes=hashes,
                                          on_bytes=on_bytes)
    except InstallError as e:
        if e.code == EXIT_CONFIG:
            raise ConfigError(str(e)) from None
        raise VerifyError(str(e)) from None
    provenance.verify_bundle_docs(bundle_dir, manifest["image"], kbytes)  # signed by the same key, of this image
    return manifest
