"""builder.foundation.sign against the real minisign CLI and openssl, plus fuzzing of key and signature text."""

from __future__ import annotations

import ast
import base64
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder.core import minisign as mv
from builder.errors import ConfigError, VerifyError
from builder.foundation import sign

MINISIGN = shutil.which("minisign")
needs_minisign = pytest.mark.skipif(
    MINISIGN is None, reason="minisign CLI not installed (apt install minisign)"
)


def minisign(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert MINISIGN is not None
    return subprocess.run(
        [MINISIGN, *args], capture_output=True, text=True, input="", timeout=60, check=False, cwd=cwd
    )


def signed_beside(payload: Path, secret: Path, comment: str) -> Path:
    """Sign ``payload`` as a bundle's manifest is signed (its bytes, a loaded key) and write the signature
    where minisign looks for it, ``PAYLOAD.minisig``."""
    out = Path(f"{payload}.minisig")
    out.write_text(sign.sign(payload.read_bytes(), sign.load_secret_key(secret), comment), encoding="utf-8")
    return out


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path, sign.PublicKey]:
    sec, pub = tmp_path / "k.key", tmp_path / "k.pub"
    pk = sign.generate_keypair(sec, pub)
    return sec, pub, pk


@pytest.fixture
def payload(tmp_path: Path) -> Path:
    p = tmp_path / "manifest.json"
    p.write_bytes(b'{"bundle": "b-1", "files": []}\n' + os.urandom(3000))
    return p


# ---------------------------------------------------------------- key files


def test_key_files_have_minisign_format_and_modes(keys: tuple[Path, Path, sign.PublicKey]) -> None:
    sec, pub, pk = keys
    lines = pub.read_text().splitlines()
    assert lines[0] == f"untrusted comment: minisign public key {pk.key_id_hex}"
    raw = base64.b64decode(lines[1])
    assert raw[:2] == b"Ed" and raw[2:10] == pk.key_id and raw[10:] == pk.key and len(raw) == 42
    assert int.from_bytes(pk.key_id, "little") == int(pk.key_id_hex, 16)
    assert stat.S_IMODE(sec.stat().st_mode) == 0o600
    assert stat.S_IMODE(pub.stat().st_mode) == 0o644
    blob = base64.b64decode(sec.read_text().splitlines()[1])
    assert len(blob) == 158 and blob[:6] == b"Ed\x00\x00B2"  # unencrypted, as minisign -G -W
    loaded = sign.load_secret_key(sec)
    assert loaded.public_key == sign.PublicKey(key_id=pk.key_id, key=pk.key)
    assert "seed" not in repr(loaded) or "<hidden>" in repr(loaded)
    assert loaded.seed.hex() not in repr(loaded)


def test_key_id_as_minisign_prints_it(tmp_path: Path) -> None:
    pk = sign.generate_keypair(tmp_path / "s", tmp_path / "p", key_id="00112233445566AA")
    assert pk.key_id == bytes.fromhex("AA66554433221100") and pk.key_id_hex == "00112233445566AA"
    assert (
        (tmp_path / "p").read_text().startswith("untrusted comment: minisign public key 00112233445566AA\n")
    )
    with pytest.raises(ConfigError, match="key id"):
        sign.generate_keypair(tmp_path / "s2", tmp_path / "p2", key_id="xyz")


def test_refuses_to_overwrite_keys_unless_forced(
    keys: tuple[Path, Path, sign.PublicKey], tmp_path: Path
) -> None:
    sec, pub, pk = keys
    before = sec.read_bytes()
    with pytest.raises(ConfigError, match="already exists"):
        sign.generate_keypair(sec, tmp_path / "other.pub")
    with pytest.raises(ConfigError, match="already exists"):
        sign.generate_keypair(tmp_path / "other.key", pub)
    assert sec.read_bytes() == before and not (tmp_path / "other.key").exists()
    pk2 = sign.generate_keypair(sec, pub, force=True)
    assert pk2.key != pk.key and sec.read_bytes() != before


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_secret_key_readable_by_others_is_refused(keys: tuple[Path, Path, sign.PublicKey], mode: int) -> None:
    sec = keys[0]
    sec.chmod(mode)
    with pytest.raises(ConfigError) as e:
        sign.load_secret_key(sec)
    msg = str(e.value)
    assert str(sec) in msg and f"{mode:04o}" in msg and "\n" not in msg
    with pytest.raises(ConfigError):
        sign.sign(b"x", sec, "c")


def test_secret_key_missing_or_damaged(keys: tuple[Path, Path, sign.PublicKey], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        sign.load_secret_key(tmp_path / "nope")
    sec = keys[0]
    lines = sec.read_text().splitlines()
    blob = bytearray(base64.b64decode(lines[1]))
    blob[70] ^= 1  # a bit of the seed: the checksum catches it
    sec.write_text(lines[0] + "\n" + base64.b64encode(bytes(blob)).decode() + "\n")
    with pytest.raises(ConfigError, match="checksum"):
        sign.load_secret_key(sec)
    blob[2:4] = b"Sc"
    sec.write_text(lines[0] + "\n" + base64.b64encode(bytes(blob)).decode() + "\n")
    with pytest.raises(ConfigError, match="password-protected"):
        sign.load_secret_key(sec)


def test_public_key_file_loading(keys: tuple[Path, Path, sign.PublicKey], tmp_path: Path) -> None:
    _, pub, pk = keys
    assert sign.load_public_key(pub) == sign.parse_public_key(pub.read_text())
    assert sign.parse_public_key(pk.base64).key == pk.key  # the bare line, as minisign -P takes
    bad = tmp_path / "bad.pub"
    bad.write_text("untrusted comment: x\nnot base64!!\n")
    with pytest.raises(ConfigError, match=str(bad)):
        sign.load_public_key(bad)
    with pytest.raises(ConfigError, match="not found"):
        sign.load_public_key(tmp_path / "none.pub")


# ---------------------------------------------------------------- sign and verify, in-process


def test_sign_verify_round_trip(keys: tuple[Path, Path, sign.PublicKey], payload: Path) -> None:
    sec, pub, _ = keys
    comment = "bundle:b-1\thost:spark-1\tversion:3"
    text = sign.sign(payload, sec, comment)
    lines = text.splitlines()
    assert len(lines) == 4 and text.endswith("\n")
    assert lines[0].startswith("untrusted comment: ") and lines[2] == f"trusted comment: {comment}"
    assert base64.b64decode(lines[1])[:2] == b"ED"
    assert sign.verify(payload, text, pub.read_text()) == comment
    assert sign.verify(payload.read_bytes(), text, pub.read_text()) == comment
    assert sign.verify_with_openssl(payload, text, pub.read_text()) == comment
    assert sign.sign(payload.read_bytes(), sec, comment) == text  # Ed25519 is deterministic


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memory files are Linux's")
def test_the_openssl_check_writes_no_file(keys: tuple[Path, Path, sign.PublicKey], payload: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """openssl reads the key, message and signature from memory files: a verifier killed mid-check (SIGKILL
    runs no clean-up) leaves nothing in the temporary folder. (The openssl on PATH here notes what the
    temporary folder holds while it runs, then runs the real one.)"""
    sec, pub, _ = keys
    text = sign.sign(payload, sec, "c")
    tmp, bin_ = tmp_path / "tmp", tmp_path / "bin"
    tmp.mkdir()
    bin_.mkdir()
    seen = tmp_path / "seen"
    real = shutil.which("openssl")
    assert real is not None
    (bin_ / "openssl").write_text(f'#!/bin/sh\nfind {tmp} -mindepth 1 >> {seen}\nexec {real} "$@"\n')
    (bin_ / "openssl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    assert sign.verify_with_openssl(payload, text, pub.read_text()) == "c"
    with pytest.raises(VerifyError):
        sign.verify_with_openssl(payload.read_bytes() + b"x", text, pub.read_text())
    assert seen.read_text() == ""


@pytest.mark.parametrize("verifier", [sign.verify, sign.verify_with_openssl])
def test_tampering_is_refused(
    keys: tuple[Path, Path, sign.PublicKey], payload: Path, tmp_path: Path, verifier: object
) -> None:
    sec, pub, _ = keys
    check = verifier  # type: ignore[assignment]
    text = sign.sign(payload, sec, "bundle:b-1")
    data = payload.read_bytes()
    pubtext = pub.read_text()

    changed = bytearray(data)
    changed[1234] ^= 0x01
    with pytest.raises(VerifyError, match="signature verification failed"):
        check(bytes(changed), text, pubtext)  # type: ignore[operator]

    lines = text.splitlines()
    forged = "\n".join([lines[0], lines[1], "trusted comment: bundle:b-2", lines[3]]) + "\n"
    with pytest.raises(VerifyError, match="comment signature"):
        check(data, forged, pubtext)  # type: ignore[operator]

    raw = bytearray(base64.b64decode(lines[1]))
    raw[20] ^= 0x80
    badsig = "\n".join([lines[0], base64.b64encode(bytes(raw)).decode(), lines[2], lines[3]]) + "\n"
    with pytest.raises(VerifyError, match="signature verification failed"):
        check(data, badsig, pubtext)  # type: ignore[operator]

    g = bytearray(base64.b64decode(lines[3]))
    g[0] ^= 0x01
    badglobal = "\n".join([*lines[:3], base64.b64encode(bytes(g)).decode()]) + "\n"
    with pytest.raises(VerifyError, match="comment signature"):
        check(data, badglobal, pubtext)  # type: ignore[operator]

    other = sign.generate_keypair(tmp_path / "o.key", tmp_path / "o.pub")
    with pytest.raises(VerifyError, match="not the trusted key"):
        check(data, text, (tmp_path / "o.pub").read_text())  # type: ignore[operator]
    # same key id, other key: the id check passes, the signature does not
    same_id = sign.PublicKey(key_id=keys[2].key_id, key=other.key)
    with pytest.raises(VerifyError, match="signature verification failed"):
        check(data, text, sign.public_key_text(same_id))  # type: ignore[operator]

    with pytest.raises(VerifyError, match="expected 4 lines"):
        check(data, "\n".join(lines[:3]), pubtext)  # type: ignore[operator]


def test_verify_names_the_source(keys: tuple[Path, Path, sign.PublicKey]) -> None:
    with pytest.raises(VerifyError, match=r"^bundle/manifest.json.minisig: signature: expected 4 lines"):
        sign.verify(b"x", "junk", keys[1].read_text(), source="bundle/manifest.json.minisig")


def test_bad_comments_are_refused(keys: tuple[Path, Path, sign.PublicKey]) -> None:
    for bad in ["two\nlines", "cr\r", " lead", "trail ", "x" * 9000]:
        with pytest.raises(ConfigError, match="trusted comment"):
            sign.sign(b"data", keys[0], bad)


def test_legacy_ed_signatures_verify(keys: tuple[Path, Path, sign.PublicKey]) -> None:
    """minisign -l writes 'Ed' signatures over the raw data; both verifiers accept them."""
    key = sign.load_secret_key(keys[0])
    priv = Ed25519PrivateKey.from_private_bytes(key.seed)
    data = b"legacy data"
    s = priv.sign(data)
    tc = b"legacy"
    text = (
        "untrusted comment: legacy\n"
        + base64.b64encode(b"Ed" + key.key_id + s).decode()
        + "\ntrusted comment: legacy\n"
        + base64.b64encode(priv.sign(s + tc)).decode()
        + "\n"
    )
    assert sign.verify(data, text, keys[2]) == "legacy"
    assert sign.verify_with_openssl(data, text, keys[1].read_text()) == "legacy"


# ---------------------------------------------------------------- interop with the real minisign CLI


@needs_minisign
def test_builder_signature_verifies_with_minisign(
    keys: tuple[Path, Path, sign.PublicKey], payload: Path
) -> None:
    sec, pub, pk = keys
    signed_beside(payload, sec, "bundle:b-1\thost:spark-1")
    r = minisign("-Vm", str(payload), "-p", str(pub))
    assert r.returncode == 0, r.stderr
    assert "Trusted comment: bundle:b-1\thost:spark-1" in r.stdout
    r = minisign("-Vm", str(payload), "-P", pk.base64)
    assert r.returncode == 0, r.stderr
    payload.write_bytes(payload.read_bytes() + b"!")
    r = minisign("-Vm", str(payload), "-p", str(pub))
    assert r.returncode != 0 and "verification failed" in r.stderr


@needs_minisign
def test_minisign_signs_with_a_builder_key(keys: tuple[Path, Path, sign.PublicKey], payload: Path) -> None:
    sec, pub, _ = keys
    r = minisign("-S", "-s", str(sec), "-m", str(payload), "-t", "signed by minisign")
    assert r.returncode == 0, r.stderr
    text = Path(str(payload) + ".minisig").read_text()
    assert sign.verify(payload, text, pub.read_text()) == "signed by minisign"
    assert sign.verify_with_openssl(payload, text, pub.read_text()) == "signed by minisign"


@needs_minisign
def test_builder_uses_a_minisign_key(tmp_path: Path, payload: Path) -> None:
    r = minisign("-G", "-W", "-p", str(tmp_path / "m.pub"), "-s", str(tmp_path / "m.key"))
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE((tmp_path / "m.key").stat().st_mode) & 0o077 == 0
    key = sign.load_secret_key(tmp_path / "m.key")
    pub = sign.load_public_key(tmp_path / "m.pub")
    assert key.public_key == sign.PublicKey(key_id=pub.key_id, key=pub.key)
    text = sign.sign(payload, key, "builder with a minisign key")
    Path(str(payload) + ".minisig").write_text(text)
    r = minisign("-Vm", str(payload), "-p", str(tmp_path / "m.pub"))
    assert r.returncode == 0, r.stderr
    # and minisign's own legacy (-l) signature with that key
    r = minisign(
        "-S", "-l", "-s", str(tmp_path / "m.key"), "-m", str(payload), "-x", str(tmp_path / "l.minisig")
    )
    assert r.returncode == 0, r.stderr
    legacy = (tmp_path / "l.minisig").read_text()
    assert base64.b64decode(legacy.splitlines()[1])[:2] == b"Ed"
    assert sign.verify(payload, legacy, pub).startswith("timestamp:")
    assert sign.verify_with_openssl(payload, legacy, (tmp_path / "m.pub").read_text()).startswith(
        "timestamp:"
    )


# ---------------------------------------------------------------- the stdlib-only verifier


def test_the_minisign_verifier_is_stdlib_only() -> None:
    src = Path(mv.__file__).read_text()
    tree = ast.parse(src)
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= set(sys.stdlib_module_names) | {"__future__"}, mods


def test_the_minisign_verifier_runs_as_a_standalone_script(
    keys: tuple[Path, Path, sign.PublicKey], payload: Path, tmp_path: Path
) -> None:
    """The verifier imports nothing of its package: run alone with python3 -I from an empty folder."""
    copy = tmp_path / "alone" / "minisign.py"
    copy.parent.mkdir()
    shutil.copy(mv.__file__, copy)
    sig = signed_beside(payload, keys[0], "bundle:b-1")
    argv = [sys.executable, "-I", str(copy), str(payload), str(sig), str(keys[1])]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=copy.parent, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert "Trusted comment: bundle:b-1" in r.stdout
    payload.write_bytes(b"changed")
    r = subprocess.run(argv, capture_output=True, text=True, cwd=copy.parent, timeout=60, check=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "signature verification failed" in r.stderr


def test_pem_from_raw_key_matches_cryptography(keys: tuple[Path, Path, sign.PublicKey]) -> None:
    pk = keys[2]
    ours = mv.ed25519_public_pem(pk.key)
    theirs = Ed25519PublicKey.from_public_bytes(pk.key).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert ours == theirs


def test_openssl_missing_is_a_verify_error(keys: tuple[Path, Path, sign.PublicKey]) -> None:
    text = sign.sign(b"d", keys[0], "c")
    with pytest.raises(VerifyError, match="not found"):
        sign.verify_with_openssl(b"d", text, keys[1].read_text(), openssl="/nonexistent/openssl")


# ---------------------------------------------------------------- fuzzing


def _fixed_material() -> tuple[str, str, str, bytes]:
    """One real key, signature and data, made once (hypothesis re-runs the test body)."""
    priv = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    pub = priv.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    key = sign.SecretKey(key_id=b"\x01\x02\x03\x04\x05\x06\x07\x08", seed=bytes(range(32)), public=pub)
    data = b"fuzz payload\n"
    return (
        sign.sign(data, key, "bundle:fuzz"),
        sign.public_key_text(key.public_key),
        sign.secret_key_text(key),
        data,
    )


SIG_TEXT, PUB_TEXT, SEC_TEXT, DATA = _fixed_material()
_TOKENS = [
    "untrusted comment: ", "trusted comment: ", "\n", "\r\n", "=", "==", "RWQ", "RUQ", "ED", "Ed",
    "A" * 56, "\x00", "é", " ", "\t", "\ud800",
]  # fmt: skip


@st.composite
def mutated(draw: st.DrawFn, base: str) -> str:
    text = base
    for _ in range(draw(st.integers(1, 5))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 8)))
        ins = draw(st.one_of(st.sampled_from(_TOKENS), st.text(max_size=6), st.just("")))
        text = text[:i] + ins + text[j:]
    return text


def _b64_mutation(base: str) -> st.SearchStrategy[str]:
    """Keep the shape, flip bits inside a base64 line: exercises the signature checks, not the parser."""

    @st.composite
    def strat(draw: st.DrawFn) -> str:
        lines = base.splitlines()
        idx = draw(
            st.sampled_from([i for i, ln in enumerate(lines) if not ln.startswith(("untrusted", "trusted"))])
        )
        raw = bytearray(base64.b64decode(lines[idx]))
        pos = draw(st.integers(0, len(raw) - 1))
        raw[pos] ^= draw(st.integers(1, 255))
        lines[idx] = base64.b64encode(bytes(raw)).decode()
        return "\n".join(lines) + "\n"

    return strat()


FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))


def _texts(base: str) -> st.SearchStrategy[str | bytes]:
    return st.one_of(mutated(base), _b64_mutation(base), st.text(max_size=200), st.binary(max_size=200))


@FUZZ
@given(_texts(SIG_TEXT), _texts(PUB_TEXT) | st.just(PUB_TEXT))
def test_fuzz_verify(minisig: str | bytes, pub: str | bytes) -> None:
    try:
        comment = sign.verify(DATA, minisig, pub)
    except VerifyError as e:
        assert "\n" not in str(e) and str(e)
    else:
        # only a text that still carries the real signature, comment and key may pass
        assert comment == "bundle:fuzz"
        assert mv.parse_signature(minisig).signature == mv.parse_signature(SIG_TEXT).signature


@FUZZ
@given(_texts(PUB_TEXT))
def test_fuzz_public_key(text: str | bytes) -> None:
    try:
        pk = sign.parse_public_key(text)
    except VerifyError as e:
        assert "\n" not in str(e)
    else:
        assert len(pk.key) == 32 and len(pk.key_id) == 8


@FUZZ
@given(_texts(SEC_TEXT))
def test_fuzz_secret_key(text: str | bytes) -> None:
    try:
        key = sign.parse_secret_key(text)
    except ConfigError as e:
        assert "\n" not in str(e)
    else:
        assert key.public_key.key == mv.parse_public_key(PUB_TEXT).key


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(_b64_mutation(SIG_TEXT))
def test_fuzz_openssl_agrees(minisig: str) -> None:
    """The openssl path refuses what the cryptography path refuses (fewer examples: it forks)."""
    with pytest.raises(VerifyError):
        sign.verify(DATA, minisig, PUB_TEXT)
    with pytest.raises(VerifyError):
        sign.verify_with_openssl(DATA, minisig, PUB_TEXT)
