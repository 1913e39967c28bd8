"""minisign-compatible Ed25519 keys and signatures (lessons.md §5.3).

- :func:`generate_keypair` writes a public key in minisign's exact format and an
  UNENCRYPTED minisign secret key (key derivation algorithm bytes zero, as ``minisign -G -W``
  writes), so the stock ``minisign -S -s KEY`` can sign with it too.
- :func:`sign` writes ``.minisig`` text with the default ``ED`` algorithm (the Ed25519
  signature covers the BLAKE2b-512 hash of the data) and a signed trusted comment.
- :func:`verify` checks with ``cryptography``; :func:`verify_with_openssl` checks with
  ``openssl pkeyutl`` through :mod:`builder.core.minisign`, the stdlib-only verifier the
  installer runs. Both give the trusted comment back or raise one-line VerifyError.

Secret material (the seed) never appears in a repr, a message or a log.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from builder.core import minisign as mv
from builder.errors import ConfigError, VerifyError
from builder.foundation.canon import atomic_write

PublicKey = mv.PublicKey
Signature = mv.Signature

SECRET_KEY_COMMENT = "minisign secret key (unencrypted, written by builder)"
SIGNATURE_COMMENT = "signature from builder secret key"
_KDF_NONE = b"\x00\x00"
_KDF_SCRYPT = b"Sc"
_CHK_ALG = b"B2"
_SECRET_KEY_LEN = 2 + 2 + 2 + 32 + 8 + 8 + 8 + 64 + 32  # 158 bytes, minisign's SeckeyStruct
_KEY_ID_HEX = re.compile(r"^[0-9A-Fa-f]{16}$")

DataOrPath = bytes | str | os.PathLike[str]


@dataclass(frozen=True, repr=False)
class SecretKey:
    """An Ed25519 key pair with its minisign key id. ``seed`` is the 32-byte private key."""

    key_id: bytes
    seed: bytes = field(repr=False)
    public: bytes

    @property
    def public_key(self) -> PublicKey:
        return PublicKey(key_id=self.key_id, key=self.public)

    def __repr__(self) -> str:
        return f"SecretKey(key_id={mv.key_id_hex(self.key_id)}, seed=<hidden>)"


def _ed25519() -> type[Ed25519PrivateKey]:
    return Ed25519PrivateKey


def _public_from_seed(seed: bytes) -> bytes:
    priv = _ed25519().from_private_bytes(seed)
    return priv.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _checksum(key_id: bytes, sk64: bytes) -> bytes:
    """minisign's secret key checksum: BLAKE2b-256(sig_alg || key id || sk)."""
    return hashlib.blake2b(mv.ALG_PUBKEY + key_id + sk64, digest_size=32).digest()


# ---------------------------------------------------------------- formats


def public_key_text(key: PublicKey, comment: str | None = None) -> str:
    """The two-line public key file, exactly as ``minisign -G`` writes it."""
    c = comment if comment is not None else f"minisign public key {key.key_id_hex}"
    _check_comment(c, "untrusted comment")
    return f"untrusted comment: {c}\n{key.base64}\n"


def secret_key_text(key: SecretKey, comment: str = SECRET_KEY_COMMENT) -> str:
    """An unencrypted minisign secret key file (kdf algorithm 0x0000, as ``minisign -G -W``)."""
    _check_comment(comment, "untrusted comment")
    sk64 = key.seed + key.public
    blob = (
        mv.ALG_PUBKEY
        + _KDF_NONE
        + _CHK_ALG
        + b"\x00" * 32  # kdf salt
        + b"\x00" * 8  # kdf opslimit
        + b"\x00" * 8  # kdf memlimit
        + key.key_id
        + sk64
        + _checksum(key.key_id, sk64)
    )
    assert len(blob) == _SECRET_KEY_LEN
    return f"untrusted comment: {comment}\n{base64.b64encode(blob).decode('ascii')}\n"


def parse_secret_key(text: str | bytes, source: str = "secret key") -> SecretKey:
    """Read an unencrypted minisign secret key; encrypted ones are refused with a hint."""
    try:
        data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    except TypeError:
        raise ConfigError(f"{source}: expected text, got {type(text).__name__}") from None
    lines = [ln.strip() for ln in data.splitlines() if ln.strip()]
    if len(lines) != 2 or not lines[0].startswith(mv.UNTRUSTED_PREFIX.rstrip()):
        raise ConfigError(
            f"{source}: not a minisign secret key (expected a comment line and one base64 line)"
        )
    try:
        blob = base64.b64decode(lines[1], validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{source}: not a minisign secret key (bad base64)") from None
    if len(blob) != _SECRET_KEY_LEN:
        raise ConfigError(
            f"{source}: not a minisign secret key ({len(blob)} bytes, expected {_SECRET_KEY_LEN})"
        )
    sig_alg, kdf_alg, chk_alg = blob[0:2], blob[2:4], blob[4:6]
    key_id, sk64, chk = blob[54:62], blob[62:126], blob[126:158]
    if sig_alg != mv.ALG_PUBKEY:
        raise ConfigError(f"{source}: unsupported signature algorithm {sig_alg!r}")
    if chk_alg != _CHK_ALG:
        raise ConfigError(f"{source}: unsupported checksum algorithm {chk_alg!r}")
    if kdf_alg == _KDF_SCRYPT:
        raise ConfigError(
            f"{source}: the key is password-protected; builder needs an unencrypted key "
            "(remove the password with `minisign -C -W -s FILE`, or make one with `builder keygen`)"
        )
    if kdf_alg != _KDF_NONE:
        raise ConfigError(f"{source}: unsupported key derivation algorithm {kdf_alg!r}")
    # minisign -W leaves the checksum zero; builder writes it; check it when present
    if chk != b"\x00" * 32 and chk != _checksum(key_id, sk64):
        raise ConfigError(f"{source}: secret key checksum mismatch (the file is damaged)")
    seed, public = sk64[:32], sk64[32:]
    if _public_from_seed(seed) != public:
        raise ConfigError(f"{source}: secret key is inconsistent (its public half does not match)")
    return SecretKey(key_id=key_id, seed=seed, public=public)


def parse_public_key(text: str | bytes, source: str = "public key") -> PublicKey:
    """A minisign public key file's text, or its bare base64 line; VerifyError when malformed."""
    try:
        return mv.parse_public_key(text)
    except mv.MinisignError as e:
        raise VerifyError(f"{source}: {_strip_what(str(e), 'public key')}") from None


def _strip_what(msg: str, what: str) -> str:
    return msg[len(what) + 2 :] if msg.startswith(what + ": ") else msg


def _check_comment(comment: str, what: str, limit: int = mv.COMMENT_MAX) -> None:
    if not isinstance(comment, str):
        raise ConfigError(f"{what}: expected text, got {type(comment).__name__}")
    if any(ch in comment for ch in "\r\n\x00"):
        raise ConfigError(f"{what}: must be one line")
    if comment != comment.strip(" \t"):
        raise ConfigError(f"{what}: must not start or end with blanks")
    try:
        size = len(comment.encode("utf-8"))
    except UnicodeEncodeError:
        raise ConfigError(f"{what}: not valid Unicode text") from None
    prefix = len(mv.TRUSTED_PREFIX if limit == mv.TRUSTED_COMMENT_MAX else mv.UNTRUSTED_PREFIX)
    if size + prefix + 1 > limit:
        raise ConfigError(f"{what}: too long ({size} bytes; minisign reads at most {limit - prefix - 1})")


# ---------------------------------------------------------------- keys on disk


def _parse_key_id(key_id: bytes | str | None) -> bytes:
    if key_id is None:
        return secrets.token_bytes(8)
    if isinstance(key_id, bytes):
        if len(key_id) != 8:
            raise ConfigError(f"key id: {len(key_id)} bytes where 8 are expected")
        return key_id
    if isinstance(key_id, str) and _KEY_ID_HEX.match(key_id):
        return int(key_id, 16).to_bytes(8, "little")  # as minisign prints it
    raise ConfigError("key id: expected 16 hex digits (as minisign prints it) or 8 bytes")


def generate_keypair(
    secret_path: str | os.PathLike[str],
    public_path: str | os.PathLike[str],
    *,
    key_id: bytes | str | None = None,
    force: bool = False,
) -> PublicKey:
    """Make an Ed25519 key pair; write the secret key (mode 0600) and the public key (0644).

    Refuses (ConfigError) to replace an existing file unless ``force``. ``key_id`` is 16 hex
    digits as minisign prints it, or the 8 raw bytes; random when None.
    """
    sp, pp = Path(secret_path), Path(public_path)
    if sp.resolve() == pp.resolve():
        raise ConfigError(f"{sp}: the secret and public key paths are the same file")
    if not force:
        for p in (sp, pp):
            if p.exists() or p.is_symlink():
                raise ConfigError(f"{p}: already exists; refusing to overwrite a key (use --force)")
    kid = _parse_key_id(key_id)
    priv = _ed25519().generate()

    seed = priv.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    key = SecretKey(key_id=kid, seed=seed, public=_public_from_seed(seed))
    atomic_write(sp, secret_key_text(key).encode("ascii"), mode=0o600)
    atomic_write(pp, public_key_text(key.public_key).encode("ascii"), mode=0o644)
    return key.public_key


def load_secret_key(path: str | os.PathLike[str]) -> SecretKey:
    """Read a secret key file; refuse one that group or others can read (ConfigError)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY)
    except FileNotFoundError:
        raise ConfigError(f"{p}: secret key file not found") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read secret key: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{p}: secret key is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise ConfigError(
                f"{p}: secret key is accessible by group or others (mode {mode:04o}); run chmod 600 {p}"
            )
        data = f.read(mv.MAX_TEXT + 1)
    if len(data) > mv.MAX_TEXT:
        raise ConfigError(f"{p}: too large to be a minisign secret key")
    return parse_secret_key(data, str(p))


def load_public_key(path: str | os.PathLike[str]) -> PublicKey:
    """Read a public key file (a trusted key in config): ConfigError when missing or malformed."""
    p = Path(path)
    try:
        data = p.read_bytes()[: mv.MAX_TEXT + 1]
    except FileNotFoundError:
        raise ConfigError(f"{p}: public key file not found") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read public key: {e.strerror}") from None
    try:
        return mv.parse_public_key(data)
    except mv.MinisignError as e:
        raise ConfigError(f"{p}: {_strip_what(str(e), 'public key')}") from None


# ---------------------------------------------------------------- sign and verify


def _message(algorithm: bytes, data_or_path: DataOrPath) -> bytes:
    try:
        return mv.signed_message(algorithm, data_or_path)
    except mv.MinisignError as e:
        raise VerifyError(str(e)) from None


def sign(
    data_or_path: DataOrPath,
    secret_key: SecretKey | str | os.PathLike[str],
    trusted_comment: str,
    *,
    untrusted_comment: str = SIGNATURE_COMMENT,
) -> str:
    """Sign bytes (``bytes``) or a file (``str`` or path); return the four-line ``.minisig`` text.

    The signature covers BLAKE2b-512 of the data (minisign's default ``ED``); the global
    signature covers signature || trusted comment, so the comment can carry what must not
    be changed (bundle id, host, version).
    """
    key = secret_key if isinstance(secret_key, SecretKey) else load_secret_key(secret_key)
    _check_comment(trusted_comment, "trusted comment", mv.TRUSTED_COMMENT_MAX)
    _check_comment(untrusted_comment, "untrusted comment")
    if isinstance(data_or_path, bytes | bytearray | memoryview):
        digest = mv.blake2b_bytes(bytes(data_or_path))
    else:
        try:
            digest = mv.blake2b_file(data_or_path)
        except mv.MinisignError as e:
            raise ConfigError(str(e)) from None
    priv = _ed25519().from_private_bytes(key.seed)
    sig = priv.sign(digest)
    tc = trusted_comment.encode("utf-8")
    global_sig = priv.sign(sig + tc)
    line2 = base64.b64encode(mv.ALG_HASHED + key.key_id + sig).decode("ascii")
    return (
        f"untrusted comment: {untrusted_comment}\n{line2}\n"
        f"trusted comment: {trusted_comment}\n{base64.b64encode(global_sig).decode('ascii')}\n"
    )


def _parse_both(
    minisig_text: str | bytes, public_key_text: str | bytes | PublicKey
) -> tuple[Signature, PublicKey]:
    try:
        sig = mv.parse_signature(minisig_text)
    except mv.MinisignError as e:
        raise VerifyError(str(e)) from None
    key = public_key_text if isinstance(public_key_text, PublicKey) else parse_public_key(public_key_text)
    try:
        mv.check_key_id(sig, key)
    except mv.MinisignError as e:
        raise VerifyError(str(e)) from None
    return sig, key


def verify(
    data_or_path: DataOrPath,
    minisig_text: str | bytes,
    public_key_text: str | bytes | PublicKey,
    *,
    source: str | None = None,
) -> str:
    """Check a minisign signature (``ED`` or legacy ``Ed``); return the trusted comment.

    VerifyError (one line, prefixed with ``source`` when given, e.g. the signature's file
    name) on a malformed signature or key, a different key id, a signature that does not
    match the data, or a changed trusted comment.
    """
    try:
        return _verify(data_or_path, minisig_text, public_key_text)
    except VerifyError as e:
        raise VerifyError(f"{source}: {e}" if source else str(e)) from None


def _verify(
    data_or_path: DataOrPath, minisig_text: str | bytes, public_key_text: str | bytes | PublicKey
) -> str:
    sig, key = _parse_both(minisig_text, public_key_text)
    message = _message(sig.algorithm, data_or_path)
    try:
        pub = Ed25519PublicKey.from_public_bytes(key.key)
    except ValueError:
        raise VerifyError("public key: not a valid Ed25519 key") from None
    try:
        pub.verify(sig.signature, message)
    except InvalidSignature:
        raise VerifyError("signature verification failed: the data does not match its signature") from None
    try:
        pub.verify(sig.global_signature, sig.signature + sig.trusted_comment)
    except InvalidSignature:
        raise VerifyError("comment signature verification failed: the trusted comment was changed") from None
    return sig.trusted_comment.decode("utf-8", "replace")


def verify_with_openssl(
    data_or_path: DataOrPath,
    minisig_text: str | bytes,
    public_key_text: str | bytes,
    *,
    openssl: str = "openssl",
    source: str | None = None,
) -> str:
    """As :func:`verify`, through ``openssl pkeyutl`` and the stdlib-only :mod:`builder.core.minisign`."""
    try:
        return mv.verify_with_openssl(data_or_path, minisig_text, public_key_text, openssl=openssl)
    except mv.MinisignError as e:
        raise VerifyError(f"{source}: {e}" if source else str(e)) from None


# ---------------------------------------------------------------- raw Ed25519 (DSSE envelopes)


def sign_raw(message: bytes, secret_key: SecretKey) -> bytes:
    """The plain Ed25519 signature of ``message`` with the key (no hashing first, no comment): what a
    DSSE envelope carries over its pre-authentication encoding."""
    return _ed25519().from_private_bytes(secret_key.seed).sign(message)


def verify_raw(message: bytes, signature: bytes, key: PublicKey, *, source: str | None = None) -> None:
    """Check a plain Ed25519 signature of ``message``; one-line VerifyError when it does not match."""
    where = f"{source}: " if source else ""
    try:
        Ed25519PublicKey.from_public_bytes(key.key).verify(signature, message)
    except ValueError:
        raise VerifyError(f"{where}public key: not a valid Ed25519 key") from None
    except InvalidSignature:
        raise VerifyError(f"{where}signature verification failed: the payload does not match its signature") from None
