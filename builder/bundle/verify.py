"""Verifying a bundle folder: the signature, then every file's hash (the installer's own rules)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from builder import installer as inst
from builder import sign
from builder.bundle.keys import read_public_key
from builder.errors import ConfigError, VerifyError


def crypto_sig_check(mbytes: bytes, sbytes: bytes, kbytes: bytes) -> str:
    """The installer's signature check done with builder.sign (cryptography) instead of openssl."""
    return sign.verify(mbytes, sbytes, kbytes, source=inst.SIGNATURE)


def verify_dir(bundle_dir: Path, key_path: Path) -> dict[str, Any]:
    """Signature, then every hash. VerifyError (exit 1) naming what is wrong; returns the manifest."""
    return verify_with_key(bundle_dir, read_public_key(key_path))


def verify_with_key(bundle_dir: Path, kbytes: bytes) -> dict[str, Any]:
    """As verify_dir, with the public key's text."""
    try:
        manifest, _, _ = inst.verify_bundle(str(bundle_dir), kbytes, sig_check=crypto_sig_check)
    except inst.InstallError as e:
        if e.code == inst.EXIT_CONFIG:
            raise ConfigError(str(e)) from None
        raise VerifyError(str(e)) from None
    return manifest
