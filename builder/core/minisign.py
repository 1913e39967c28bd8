"""Verify minisign signatures with the Python standard library and the openssl CLI alone.

Standard library only, as all of builder.core (the installer runs it on a fresh DGX OS with only
python3, docker and openssl), and it imports nothing else: ``python3 minisign.py`` checks a file
alone. builder.foundation.sign uses the same parsers.

Formats (https://jedisct1.github.io/minisign):

- public key: ``untrusted comment: ...`` then base64("Ed" || key id (8) || Ed25519 key (32));
- ``.minisig``: ``untrusted comment: ...``, base64(algorithm (2) || key id (8) || signature (64)),
  ``trusted comment: ...``, base64(global signature (64)).
  Algorithm ``ED`` signs the BLAKE2b-512 hash of the file (the default), ``Ed`` (legacy)
  the file itself. The global signature covers signature || trusted comment bytes.

Ed25519 verification runs ``openssl pkeyutl -verify -pubin -rawin`` (OpenSSL 3.0 or newer)
on a PEM key built from the raw 32 bytes with the fixed SPKI prefix.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

UNTRUSTED_PREFIX = b"untrusted comment: "
TRUSTED_PREFIX = b"trusted comment: "
ALG_PUBKEY = b"Ed"  # public keys and secret keys carry the key algorithm
ALG_HASHED = b"ED"  # signature over BLAKE2b-512(file)
ALG_LEGACY = b"Ed"  # signature over the file itself
#: minisign's limits (COMMENTMAXBYTES, TRUSTEDCOMMENTMAXBYTES), newline included.
COMMENT_MAX = 1024
TRUSTED_COMMENT_MAX = 8192
#: DER prefix of an Ed25519 SubjectPublicKeyInfo (RFC 8410); the raw key follows.
ED25519_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")
READ_SIZE = 4 * 1024 * 1024
MAX_TEXT = 64 * 1024  # no public key or signature file is near this


class MinisignError(ValueError):
    """A malformed key or signature, a mismatch, or openssl missing: one line."""


@dataclass(frozen=True)
class PublicKey:
    key_id: bytes  # 8 bytes, as stored (little-endian)
    key: bytes  # 32 bytes
    untrusted_comment: str = ""

    @property
    def key_id_hex(self) -> str:
        return key_id_hex(self.key_id)

    @property
    def base64(self) -> str:
        return base64.b64encode(ALG_PUBKEY + self.key_id + self.key).decode("ascii")


@dataclass(frozen=True)
class Signature:
    algorithm: bytes  # b"ED" or b"Ed"
    key_id: bytes
    signature: bytes  # 64
    trusted_comment: bytes  # the bytes after "trusted comment: ", no line ending
    global_signature: bytes  # 64
    untrusted_comment: str = ""


def key_id_hex(key_id: bytes) -> str:
    """The key id as minisign prints it: the 8 bytes read as a little-endian number, 16 hex digits."""
    return f"{int.from_bytes(key_id, 'little'):016X}"


def _as_bytes(text: str | bytes, what: str) -> bytes:
    if isinstance(text, str):
        data = text.encode("utf-8", "surrogatepass")
    elif isinstance(text, bytes | bytearray | memoryview):
        data = bytes(text)
    else:
        raise MinisignError(f"{what}: expected text, got {type(text).__name__}")
    if len(data) > MAX_TEXT:
        raise MinisignError(f"{what}: too large ({len(data)} bytes) to be a minisign file")
    return data


def _lines(data: bytes) -> list[bytes]:
    # minisign reads lines with fgets and strips CR and LF
    return [ln.rstrip(b"\r") for ln in data.split(b"\n")]


def _b64(line: bytes, size: int, what: str) -> bytes:
    try:
        raw = base64.b64decode(line.strip(b" \t"), validate=True)
    except (binascii.Error, ValueError):
        raise MinisignError(f"{what}: not valid base64") from None
    if len(raw) != size:
        raise MinisignError(f"{what}: {len(raw)} bytes where {size} are expected")
    return raw


def _comment(line: bytes, prefix: bytes, what: str) -> str:
    if not line.startswith(prefix):
        raise MinisignError(f"{what}: the line should start with {prefix.decode()!r}")
    return line[len(prefix) :].decode("utf-8", "replace")


def parse_public_key(text: str | bytes) -> PublicKey:
    """A minisign public key file (two lines) or its bare base64 line (as ``minisign -P`` takes)."""
    data = _as_bytes(text, "public key")
    lines = [ln for ln in _lines(data) if ln.strip()]
    comment = ""
    if lines and lines[0].startswith(UNTRUSTED_PREFIX):
        comment = _comment(lines[0], UNTRUSTED_PREFIX, "public key")
        lines = lines[1:]
    if len(lines) != 1:
        raise MinisignError("public key: expected an untrusted comment line and one base64 line")
    raw = _b64(lines[0], 42, "public key")
    if raw[:2] != ALG_PUBKEY:
        raise MinisignError(f"public key: unsupported algorithm {raw[:2]!r}")
    return PublicKey(key_id=raw[2:10], key=raw[10:42], untrusted_comment=comment)


def parse_signature(text: str | bytes) -> Signature:
    """A ``.minisig`` file: four lines, as minisign writes and reads them."""
    data = _as_bytes(text, "signature")
    lines = _lines(data)
    while lines and lines[-1] == b"":
        lines.pop()
    if len(lines) != 4:
        raise MinisignError(f"signature: expected 4 lines, found {len(lines)}")
    if len(lines[0]) + 1 > COMMENT_MAX:
        raise MinisignError("signature: untrusted comment too long")
    untrusted = _comment(lines[0], UNTRUSTED_PREFIX, "signature: line 1")
    raw = _b64(lines[1], 74, "signature: line 2")
    alg = raw[:2]
    if alg not in (ALG_HASHED, ALG_LEGACY):
        raise MinisignError(f"signature: unsupported algorithm {alg!r}")
    if not lines[2].startswith(TRUSTED_PREFIX):
        raise MinisignError(f"signature: line 3 should start with {TRUSTED_PREFIX.decode()!r}")
    trusted = lines[2][len(TRUSTED_PREFIX) :]
    if len(lines[2]) + 1 > TRUSTED_COMMENT_MAX:
        raise MinisignError("signature: trusted comment too long")
    global_sig = _b64(lines[3], 64, "signature: line 4")
    return Signature(
        algorithm=alg,
        key_id=raw[2:10],
        signature=raw[10:74],
        trusted_comment=trusted,
        global_signature=global_sig,
        untrusted_comment=untrusted,
    )


def blake2b_bytes(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=64).digest()


def blake2b_file(path: str | os.PathLike[str]) -> bytes:
    """BLAKE2b-512 of a file, streamed (the ``ED`` prehash)."""
    h = hashlib.blake2b(digest_size=64)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(READ_SIZE):
                h.update(chunk)
    except OSError as e:
        raise MinisignError(f"{os.fspath(path)}: cannot read: {e.strerror}") from None
    return h.digest()


def signed_message(algorithm: bytes, data_or_path: bytes | str | os.PathLike[str]) -> bytes:
    """What the Ed25519 signature covers: the BLAKE2b-512 hash (``ED``) or the data itself (``Ed``).

    ``bytes`` are the data; a ``str`` or path names a file.
    """
    if isinstance(data_or_path, bytes | bytearray | memoryview):
        data = bytes(data_or_path)
        return blake2b_bytes(data) if algorithm == ALG_HASHED else data
    if algorithm == ALG_HASHED:
        return blake2b_file(data_or_path)
    try:
        with open(data_or_path, "rb") as f:
            return f.read()
    except OSError as e:
        raise MinisignError(f"{os.fspath(data_or_path)}: cannot read: {e.strerror}") from None


def ed25519_public_pem(key: bytes) -> bytes:
    """A PEM ``PUBLIC KEY`` for a raw 32-byte Ed25519 key."""
    if len(key) != 32:
        raise MinisignError(f"public key: {len(key)} bytes where 32 are expected")
    body = base64.b64encode(ED25519_SPKI_PREFIX + key)
    return b"-----BEGIN PUBLIC KEY-----\n" + body + b"\n-----END PUBLIC KEY-----\n"


@contextlib.contextmanager
def _files(blobs: dict[str, bytes]) -> Iterator[tuple[dict[str, str], tuple[int, ...]]]:
    """Paths openssl reads ``blobs`` from, and the descriptors it must inherit for them: anonymous memory
    files (``/dev/fd/N``) where the system has them, so that a verifier killed mid-check leaves nothing on
    disk; else files in a temporary folder. (openssl takes an Ed25519 message only from a file whose size
    it can read: not from a pipe or stdin.)"""
    if hasattr(os, "memfd_create") and os.path.isdir("/dev/fd"):
        fds: dict[str, int] = {}
        try:
            for name, blob in blobs.items():
                fds[name] = fd = os.memfd_create(f"minisign-{name}")
                _write_all(fd, blob)
            yield {name: f"/dev/fd/{fd}" for name, fd in fds.items()}, tuple(fds.values())
        finally:
            for fd in fds.values():
                os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="minisign-verify.") as tmp:
        for name, blob in blobs.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(blob)
        yield {name: os.path.join(tmp, name) for name in blobs}, ()


def _write_all(fd: int, blob: bytes) -> None:
    view = memoryview(blob)
    while view:
        view = view[os.write(fd, view):]


def openssl_ed25519_verify(
    key: bytes, message: bytes, signature: bytes, *, openssl: str = "openssl", timeout: float = 120.0
) -> bool:
    """True when ``signature`` is a valid Ed25519 signature of ``message`` under ``key``, per openssl."""
    exe = shutil.which(openssl)
    if exe is None:
        raise MinisignError(f"{openssl}: not found on PATH (signature checks need OpenSSL 3.0 or newer)")
    if len(signature) != 64:
        return False
    blobs = {"pub.pem": ed25519_public_pem(key), "msg": message, "sig": signature}
    with _files(blobs) as (paths, fds):
        argv = [exe, "pkeyutl", "-verify", "-pubin", "-inkey", paths["pub.pem"], "-rawin", "-in", paths["msg"],
                "-sigfile", paths["sig"]]
        try:
            p = subprocess.run(argv, capture_output=True, timeout=timeout, check=False, pass_fds=fds)
        except subprocess.TimeoutExpired:
            raise MinisignError(f"{openssl} pkeyutl: no answer within {timeout:g} s") from None
        except OSError as e:
            raise MinisignError(f"{openssl}: cannot run: {e.strerror}") from None
    out = (p.stdout + p.stderr).decode("utf-8", "replace")
    if p.returncode == 0 and "Signature Verified Successfully" in out:
        return True
    if "Signature Verification Failure" in out:
        return False
    first = next((ln.strip() for ln in out.splitlines() if ln.strip()), f"exit status {p.returncode}")
    raise MinisignError(f"{openssl} pkeyutl -verify failed: {first}")


def check_key_id(sig: Signature, key: PublicKey) -> None:
    if sig.key_id != key.key_id:
        raise MinisignError(
            f"signature was made with key {key_id_hex(sig.key_id)}, not the trusted key {key.key_id_hex}"
        )


def verify_with_openssl(
    data_or_path: bytes | str | os.PathLike[str],
    minisig_text: str | bytes,
    public_key_text: str | bytes,
    *,
    openssl: str = "openssl",
) -> str:
    """Check a minisign signature with openssl; return the (now trusted) comment or raise MinisignError.

    Checks, in minisign's order: the key id, the signature over the file (or its BLAKE2b-512
    hash), then the global signature over signature || trusted comment.
    """
    sig = parse_signature(minisig_text)
    key = parse_public_key(public_key_text)
    check_key_id(sig, key)
    message = signed_message(sig.algorithm, data_or_path)
    if not openssl_ed25519_verify(key.key, message, sig.signature, openssl=openssl):
        raise MinisignError("signature verification failed: the file does not match its signature")
    if not openssl_ed25519_verify(
        key.key, sig.signature + sig.trusted_comment, sig.global_signature, openssl=openssl
    ):
        raise MinisignError("comment signature verification failed: the trusted comment was changed")
    return sig.trusted_comment.decode("utf-8", "replace")


if __name__ == "__main__":  # python3 minisign.py FILE FILE.minisig KEY.pub
    if len(sys.argv) != 4:
        sys.stderr.write("usage: minisign.py FILE SIGNATURE PUBLIC_KEY\n")
        sys.exit(2)
    try:
        with open(sys.argv[2], "rb") as s, open(sys.argv[3], "rb") as k:
            comment = verify_with_openssl(sys.argv[1], s.read(MAX_TEXT + 1), k.read(MAX_TEXT + 1))
    except (MinisignError, OSError) as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1)
    sys.stdout.write(f"Signature and comment signature verified\nTrusted comment: {comment}\n")
