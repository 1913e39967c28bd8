"""Property-based tests of every parser that reads outside input (hypothesis, 1000 examples each).

Inputs come three ways: byte-level mutations of a valid file (flipped bits, inserted and deleted bytes,
truncation), structural mutations of a valid document (a value replaced by any JSON-able value, a key
removed or added, a list item duplicated) written back as TOML/JSON, and small random documents.
Every example must end in a valid result or in the parser's expected error with a clean one-line
message, and must write nothing (the folder's listing is compared before and after).
nvidia-smi output is fuzzed in tests/test_gpu.py.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
import re
import shutil
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import testinfra
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder.bundle import BundleOptions, load_bundle_inputs, make_bundle, verify_with_key
from builder.errors import BuilderError
from builder.foundation import sign
from builder.inputs.hosts import Fleet, load_fleet
from builder.inputs.loader import known_keys
from builder.inputs.pins import Pins, load_pins
from builder.installer.errors import InstallError as InstallError
from builder.installer.manifest import (
    MANIFEST,
    SIGNATURE,
    check_manifest,
    physical_files,
    release_files,
    trusted_comment_for,
)
from builder.installer.record import model_cached, write_record
from builder.installer.release import status
from builder.installer.root import Root
from builder.installer.verify import check_signature_form, verify_bundle
from builder.lock.lockfile import check_lock, load_lock, render_lock
from builder.lock.resolve import ResolveOptions, resolve
from tests.lib import bundlelib as bl
from tests.lib import checkmods, factory, rlib

FUZZ = settings(
    max_examples=1000,
    deadline=None,
    derandomize=False,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
CLI_FUZZ = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# --------------------------------------------------------------------------- value strategies

INTERESTING = [
    "",
    " ",
    "..",
    "../x",
    "a/../../b",
    "/etc/passwd",
    "a" * 64,
    "0" * 64,
    "0" * 40,
    "sha256:" + "0" * 64,
    "main",
    "linux/arm64",
    "linux/amd64",
    "head",
    "worker",
    "x\ny",
    "\x00",
    "images/demo",
    "images/../x",
    "zig",
    "wheel",
    "cuda",
    "demo",
    "-rf",
    "ü",
    "\ud800",
]
leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-2, max_value=70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24),
    st.sampled_from(INTERESTING),
)
json_value = st.recursive(
    leaf,
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=10), c, max_size=4)),
    max_leaves=12,
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def mutate(data: st.DataObject, doc: Any, n_max: int = 4) -> Any:
    """1..n_max structural mutations of a deep copy of doc."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, n_max), label="mutations")):
        path = data.draw(st.sampled_from(_paths(doc)), label="path")
        op = data.draw(st.sampled_from(["replace", "replace", "delete", "add", "dup"]), label="op")
        if not path:
            if op == "replace":
                doc = data.draw(json_value)
            elif isinstance(doc, dict) and op == "add":
                doc[data.draw(st.text(max_size=10))] = data.draw(json_value)
            continue
        parent, key = _get(doc, path[:-1]), path[-1]
        if op == "replace":
            parent[key] = data.draw(json_value, label="value")
        elif op == "delete":
            del parent[key]
        elif op == "add":
            target = parent[key]
            if isinstance(target, dict):
                target[data.draw(st.sampled_from(["extra", "note", "x"]) | st.text(max_size=8))] = data.draw(json_value)
            elif isinstance(target, list):
                target.append(data.draw(json_value))
            else:
                parent[key] = [target, data.draw(json_value)]
        elif op == "dup" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
    return doc


def mutate_bytes(data: st.DataObject, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 6), label="byte edits")):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate", "replace"]), label="edit")
        pos = data.draw(st.integers(0, max(0, len(b))), label="pos")
        if op == "flip" and b:
            pos = min(pos, len(b) - 1)
            b[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "insert":
            b[pos:pos] = data.draw(
                st.binary(min_size=1, max_size=8)
                | st.sampled_from(
                    [
                        b"\n",
                        b"[",
                        b"]",
                        b"{",
                        b"}",
                        b'"',
                        b"=",
                        b",",
                        b"\\",
                        b"\xff",
                        b"\x00",
                        b"#",
                        b"\n[x]\n",
                    ]
                )
            )
        elif op == "delete":
            del b[pos : pos + data.draw(st.integers(1, 16))]
        elif op == "truncate":
            del b[pos:]
        elif op == "replace" and b:
            pos = min(pos, len(b) - 1)
            b[pos] = data.draw(st.integers(0, 255))
    return bytes(b)


# --------------------------------------------------------------------------- a tiny TOML writer


def _toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _toml_value(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, list):
        items = [_toml_value(x) for x in v]
        return "[" + ", ".join(x if x is not None else '""' for x in items) + "]"
    if isinstance(v, dict):
        parts = [f"{_toml_str(str(k))} = {tv}" for k, x in v.items() if (tv := _toml_value(x)) is not None]
        return "{" + ", ".join(parts) + "}"
    raise TypeError(type(v))


def to_toml(doc: Any) -> bytes:
    """Any JSON-able value as TOML text (a non-table top level gives a key `value`)."""
    if not isinstance(doc, dict):
        doc = {"value": doc}
    lines = []
    for k, v in doc.items():
        tv = _toml_value(v)
        if tv is not None:
            lines.append(f"{_toml_str(str(k))} = {tv}")
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")


def to_json(doc: Any) -> bytes:
    return json.dumps(doc, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")


def draw_document(data: st.DataObject, seeds: list[bytes], parse: Any, dump: Any) -> bytes:
    """A document derived from one of the seeds (text edits or structural edits) or a random one."""
    seed = data.draw(st.sampled_from(seeds), label="seed")
    how = data.draw(st.sampled_from(["bytes", "struct", "struct", "random", "seed"]), label="how")
    if how == "bytes":
        return mutate_bytes(data, seed)
    if how == "struct":
        return dump(mutate(data, parse(seed)))
    if how == "random":
        return dump(data.draw(json_value))
    return seed


def _toml_load(b: bytes) -> Any:
    return tomllib.loads(b.decode("utf-8"))


def _json_load(b: bytes) -> Any:
    return json.loads(b)


def fuzz_toml_file(
    path: Path, data: st.DataObject, seeds: list[bytes], load: Callable[[Path], Any], check: Callable[[Any], None]
) -> None:
    """Write a fuzzed TOML document to `path` and load it: a valid result passes `check`, or the load
    fails with a one-line BuilderError; either way nothing is written beside it."""
    path.write_bytes(draw_document(data, seeds, _toml_load, to_toml))
    before = rlib.listing(path.parent)
    try:
        obj = load(path)
    except BuilderError as e:
        assert_unknown_key_form(rlib.assert_one_line(e), path)
    else:
        check(obj)
    assert rlib.listing(path.parent) == before


# FILE: KEY: unknown key [(did you mean `KEY`?)] [(and N more)]
_UNKNOWN = re.compile(r"^(?P<file>.+?): (?P<key>.+): unknown key(?: \(did you mean `(?P<hint>[^`]+)`\?\))?"
                      r"(?: \(and \d+ more\))?$")


def assert_unknown_key_form(msg: str, path: Path) -> re.Match[str] | None:
    """A message about an unknown key names the file first, then the key, then at most one suggestion."""
    if ": unknown key" not in msg:
        return None
    m = _UNKNOWN.match(msg)
    assert m is not None and m["file"] == str(path), msg
    assert "missing required key" not in msg, msg
    return m


# --------------------------------------------------------------------------- seeds

PINS_SEEDS = [(rlib.REPO / "pins.toml").read_bytes()]
PINS_SEEDS.append(
    b"""format = 1
[sources.engine]
url = "file:///nonexistent/engine.git"
ref = "main"
rev = "0123456"
patches = [{ file = "patches/0001.patch", reason = "fix" }]
[toolchains.zig]
kind = "zig"
version = "0.13.0"
[toolchains.zig.platforms."linux/arm64"]
url = "https://example.invalid/zig.tar.xz"
sha256 = "%s"
[bases.deb]
ref = "debian:bookworm"
platforms = ["linux/arm64"]
[files.t]
url = "files/t.jinja"
sha256 = "%s"
[models.m]
repo = "org/m"
revision = "main"
include = ["*.json"]
[images.demo]
recipe = "images/demo"
base = "deb"
sources = ["engine"]
toolchains = ["zig"]
files = ["t"]
[lanes.demo]
image = "demo"
models = ["m"]
[lanes.demo.serve]
tensor_parallel = 2
context = 4096
streams = 1
port = 8000
served_name = "m"
[lanes.demo.env]
A_B = "1"
"""
    % (b"a" * 64, b"b" * 64)
)
FLEET_SEEDS = [p.read_bytes() for p in sorted((rlib.REPO / "hosts").glob("*.toml"))]


@pytest.fixture(scope="module")
def lock_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project whose lock resolves offline (a local file, a local model, a recipe); returns its root."""
    root = tmp_path_factory.mktemp("lockproj") / "proj"
    (root / "images" / "demo").mkdir(parents=True)
    (root / "images" / "demo" / "Dockerfile").write_text("FROM scratch\n")
    (root / "files").mkdir()
    (root / "files" / "t.jinja").write_bytes(b"{{ m }}\n")
    m = root / "models" / "tiny"
    m.mkdir(parents=True)
    (m / "config.json").write_text("{}\n")
    (m / "w-r0of1.bin").write_bytes(b"\x01" * 100)
    factory.write_pins(root, factory.pins(
        files={"t": {"url": "files/t.jinja", "sha256": hashlib.sha256(b"{{ m }}\n").hexdigest()}},
        models={"tiny": factory.model("org/tiny", "c" * 40, local="models/tiny")},
        images={"demo": factory.image("images/demo", files=["t"])},
        lanes={"demo": factory.lane("demo", ["tiny"], serve={
            "tensor_parallel": 1, "context": 1024, "streams": 1, "port": 8000, "served_name": "tiny"})},
    ))
    rep = resolve(root / "pins.toml", root / "pins.lock", ResolveOptions(offline=True, cache=root / ".c"))
    assert not rep.failed, rep.failed
    shutil.rmtree(root / ".c", ignore_errors=True)
    return root


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A real signed bundle (no image) and its public key."""
    base = tmp_path_factory.mktemp("bundleproj")
    p = bl.make_project(base)
    ctx = load_bundle_inputs(p.pins, p.root / "pins.lock", p.store)
    d = make_bundle(ctx, "spark-b", BundleOptions(key=p.key, out=base / "b", with_models=True, part_size=4096)).path
    return d, p.pub


# --------------------------------------------------------------------------- pins.toml


@FUZZ
@given(data=st.data())
def test_pins_parser(tmp_path: Path, data: st.DataObject) -> None:
    def check(pins: Any) -> None:
        for kind in pins.all_inputs().values():
            assert isinstance(kind, set)
        for lane in pins.lanes:
            pins.closure([lane])

    fuzz_toml_file(tmp_path / "pins.toml", data, PINS_SEEDS, load_pins, check)


# --------------------------------------------------------------------------- the lock


@FUZZ
@given(data=st.data())
def test_lock_parser_and_check(lock_project: Path, data: st.DataObject) -> None:
    good = (lock_project / "pins.lock").read_bytes()
    work = lock_project.parent / "work"
    if not work.exists():
        shutil.copytree(lock_project, work)
    lock = work / "pins.lock"
    lock.write_bytes(draw_document(data, [good], _json_load, to_json))
    before = rlib.snapshot(work)
    canonical = False
    try:
        lk = load_lock(lock)
    except BuilderError as e:
        rlib.assert_one_line(e)
    else:
        lk.lock_hash()
        canonical = render_lock(lk) == lock.read_bytes()
    try:
        res = check_lock(work / "pins.toml", lock)
    except BuilderError as e:
        rlib.assert_one_line(e)
    else:
        for p in res.problems:
            assert p.strip() and "\n" not in p
        # a lock not in the form `builder lock` writes is never reported current, and neither is one
        # whose values were edited in that form (the seal, sha256 of the content, no longer matches)
        assert canonical or not res.ok
        assert res.ok == (lock.read_bytes() == good), res.problems
    assert rlib.snapshot(work) == before


# --------------------------------------------------------------------------- host inventories


@FUZZ
@given(data=st.data())
def test_fleet_parser(tmp_path: Path, data: st.DataObject) -> None:
    def check(fleet: Any) -> None:
        ranks = [h.rank for h in fleet.by_rank()]
        assert ranks == list(range(len(ranks))) and fleet.head().role == "head"

    fuzz_toml_file(tmp_path / "fleet.toml", data, FLEET_SEEDS, load_fleet, check)


# --------------------------------------------------------------------------- a misspelt key


def _schema_keys(doc: Any, model: Any) -> list[tuple[tuple[Any, ...], str]]:
    """(parent path, key) for every key of doc that the schema knows (not a name the user chose)."""
    return [(path[:-1], path[-1]) for path in _paths(doc)
            if path and isinstance(path[-1], str) and path[-1] in known_keys(model, path[:-1])]


def _typo(data: st.DataObject, key: str) -> str:
    """One edit of key: a letter dropped, added, replaced, or two swapped."""
    op = data.draw(st.sampled_from(["drop", "add", "replace", "swap"]), label="typo")
    i = data.draw(st.integers(0, len(key) - 1), label="at")
    letter = data.draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz_"), label="letter")
    if op == "drop" and len(key) > 1:
        return key[:i] + key[i + 1:]
    if op == "add":
        return key[:i] + letter + key[i:]
    if op == "swap" and i + 1 < len(key):
        return key[:i] + key[i + 1] + key[i] + key[i + 2:]
    return key[:i] + letter + key[i + 1:]


def check_misspelt_key(data: st.DataObject, seed: bytes, model: Any, load: Callable[[Path], Any], path: Path
                       ) -> None:
    """A valid document with one schema key misspelt: the error is one line naming the file and the
    misspelt key (before any "missing" message), with the closest known key as its suggestion."""
    doc = _toml_load(seed)
    parent, key = data.draw(st.sampled_from(_schema_keys(doc, model)), label="key")
    known = known_keys(model, parent)
    typo = _typo(data, key)
    table = _get(doc, parent)
    if typo in known or typo in table:
        return  # (another real key: not a misspelling)
    table[typo] = table.pop(key)
    path.write_bytes(to_toml(doc))
    before = rlib.listing(path.parent)
    with pytest.raises(BuilderError) as e:
        load(path)
    msg = rlib.assert_one_line(e.value)
    m = assert_unknown_key_form(msg, path)
    assert m is not None, msg
    assert m["key"].endswith(typo) or m["key"].endswith(json.dumps(typo)), msg
    want = difflib.SequenceMatcher(None, typo, key).ratio()
    candidates = known - set(table)
    best = max(difflib.SequenceMatcher(None, typo, c).ratio() for c in candidates | {key})
    if want >= 0.6:
        assert m["hint"] is not None, msg
        got = difflib.SequenceMatcher(None, typo, m["hint"]).ratio()
        assert m["hint"] in candidates | {key} and got == best >= want, msg
    elif best < 0.6:
        assert m["hint"] is None, msg
    assert rlib.listing(path.parent) == before


@FUZZ
@given(data=st.data())
def test_pins_misspelt_key(tmp_path: Path, data: st.DataObject) -> None:
    check_misspelt_key(data, data.draw(st.sampled_from(PINS_SEEDS)), Pins, load_pins, tmp_path / "pins.toml")


@FUZZ
@given(data=st.data())
def test_fleet_misspelt_key(tmp_path: Path, data: st.DataObject) -> None:
    check_misspelt_key(data, data.draw(st.sampled_from(FLEET_SEEDS)), Fleet, load_fleet, tmp_path / "fleet.toml")


def test_a_misspelt_serve_key_is_named_with_its_fix(tmp_path: Path) -> None:
    """A misspelt key (`tensor_paralel`) in a lane's serve table, through the real CLI."""
    text = PINS_SEEDS[0].decode()
    assert "\ntensor_parallel = " in text
    (tmp_path / "pins.toml").write_text(text.replace("\ntensor_parallel = ", "\ntensor_paralel = ", 1))
    for name in ("engine-src", "images", "files", "models", "patches"):
        src = rlib.REPO / name
        if src.exists():
            (tmp_path / name).symlink_to(src)
    p = rlib.run_builder("--pins", str(tmp_path / "pins.toml"), "lock", "--check", cwd=tmp_path)
    rlib.assert_clean_cli(p, allowed=(2,))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines == [f"error: {tmp_path / 'pins.toml'}: lanes.demo.serve.tensor_paralel: unknown key "
                     "(did you mean `tensor_parallel`?) (and 1 more)"], p.stderr


# --------------------------------------------------------------------------- bundle manifests


@FUZZ
@given(data=st.data())
def test_manifest_structure(bundle_dir: tuple[Path, Path], data: st.DataObject) -> None:
    """check_manifest on any structural mutation: InstallError (one line) or the manifest."""
    good = json.loads((bundle_dir[0] / MANIFEST).read_bytes())
    obj = mutate(data, good) if data.draw(st.booleans()) else data.draw(json_value)
    try:
        out = check_manifest(obj)
    except InstallError as e:
        rlib.assert_one_line(e)
    else:
        assert out is obj
        physical_files(out)
        release_files(out)
        trusted_comment_for(out)


@FUZZ
@given(data=st.data())
def test_manifest_and_signature_files(bundle_dir: tuple[Path, Path], data: st.DataObject) -> None:
    """A bundle whose manifest or signature bytes changed: verify refuses in one line, writes nothing."""
    src, pub = bundle_dir
    work = src.parent / "fuzz-bundle"
    if not work.exists():
        shutil.copytree(src, work)
    mgood = (src / MANIFEST).read_bytes()
    sgood = (src / SIGNATURE).read_bytes()
    target = data.draw(st.sampled_from([MANIFEST, SIGNATURE]))
    if target == MANIFEST:
        new = draw_document(data, [mgood], _json_load, to_json)
        (work / SIGNATURE).write_bytes(sgood)
    else:
        new = mutate_bytes(data, sgood)
        (work / MANIFEST).write_bytes(mgood)
    (work / target).write_bytes(new)
    before = rlib.listing(work)
    changed = new != (mgood if target == MANIFEST else sgood)
    try:
        verify_with_key(work, pub.read_bytes())
    except BuilderError as e:
        rlib.assert_one_line(e)
    else:
        assert not changed, "a changed manifest or signature was accepted"
    # and without the signature (--insecure): the structure and hash checks alone
    try:
        verify_bundle(str(work), None, insecure=True)
    except InstallError as e:
        rlib.assert_one_line(e)
    assert rlib.listing(work) == before and (work / target).read_bytes() == new
    (work / MANIFEST).write_bytes(mgood)
    (work / SIGNATURE).write_bytes(sgood)


# --------------------------------------------------------------------------- keys and signatures


@FUZZ
@given(data=st.data())
def test_key_and_signature_parsers(bundle_dir: tuple[Path, Path], data: st.DataObject) -> None:
    _, pub = bundle_dir
    seeds = [pub.read_bytes(), (pub.parent / "builder.key").read_bytes()]
    text = (
        mutate_bytes(data, data.draw(st.sampled_from(seeds)))
        if data.draw(st.booleans())
        else data.draw(st.binary(max_size=300))
    )
    for fn in (sign.parse_public_key, sign.parse_secret_key):
        try:
            fn(text)
        except BuilderError as e:
            rlib.assert_one_line(e)
    try:
        check_signature_form(text)
    except InstallError as e:
        rlib.assert_one_line(e)


# --------------------------------------------------------------------------- apply records


@pytest.fixture(scope="module")
def applied_seed(tmp_path_factory: pytest.TempPathFactory, bundle_dir: tuple[Path, Path]) -> bytes:
    """An apply record as the installer writes it (for a bundle installed into a tmp root)."""
    manifest = json.loads((bundle_dir[0] / MANIFEST).read_bytes())
    manifest["models"] = []
    r = Root(str(tmp_path_factory.mktemp("applied")))
    rec = write_record(r, manifest, b"{}", "install", None)
    return (json.dumps(rec, sort_keys=True, indent=2) + "\n").encode()


@FUZZ
@given(data=st.data())
def test_apply_record_readers(tmp_path: Path, applied_seed: bytes, data: st.DataObject) -> None:
    """The audit's reader (checks/checklib.py, through a real testinfra local host) and the installer's
    status: never raise on any record."""
    checklib: Any = checkmods.checklib()

    text = draw_document(data, [applied_seed], _json_load, to_json)
    root = tmp_path / "root"
    (root / "state").mkdir(parents=True, exist_ok=True)
    (root / "state" / "applied.json").write_bytes(text)
    checklib.APPLIED_CACHE.clear()
    checklib.RAN.clear()
    rec, why = checklib.read_applied(
        testinfra.get_host("local://"), {"applied_path": str(root / "state" / "applied.json")}
    )
    assert (rec is None) == bool(why)
    assert rec is None or isinstance(rec, dict)
    assert "\n" not in why
    before = rlib.snapshot(root)
    st_ = status(str(root))
    assert st_["current"] is None and isinstance(st_["consistent"], bool)
    if isinstance(rec, dict) and isinstance(rec.get("bundle_id"), str):
        assert st_["consistent"] is False  # a record naming a bundle, but no `current` link
    assert rlib.snapshot(root) == before


def test_install_survives_a_damaged_apply_record_models_field(tmp_path: Path) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 10)
    m = {"path": str(f), "sha256": "0" * 64, "size": 10}
    assert model_cached(m, {"models": 5}) is False
    assert model_cached(m, {"models": None}) is False
    assert model_cached(m, "garbage") is False  # type: ignore[arg-type]


# --------------------------------------------------------------------------- through the real CLI


@CLI_FUZZ
@given(data=st.data())
def test_cli_lock_check_on_fuzzed_pins(lock_project: Path, data: st.DataObject) -> None:
    work = lock_project.parent / "cli-work"
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(lock_project, work)
    (work / "pins.toml").write_bytes(
        draw_document(data, PINS_SEEDS + [(lock_project / "pins.toml").read_bytes()], _toml_load, to_toml)
    )
    before = rlib.snapshot(work)
    p = rlib.run_builder("--pins", str(work / "pins.toml"), "lock", "--check", cwd=work)
    rlib.assert_clean_cli(p)
    assert rlib.snapshot(work) == before


@CLI_FUZZ
@given(data=st.data())
def test_cli_hosts_on_fuzzed_inventories(tmp_path: Path, data: st.DataObject) -> None:
    work = tmp_path / "proj"
    (work / "hosts").mkdir(parents=True, exist_ok=True)
    (work / "pins.toml").write_bytes(PINS_SEEDS[0])
    (work / "hosts" / "f.toml").write_bytes(draw_document(data, FLEET_SEEDS, _toml_load, to_toml))
    before = rlib.snapshot(work)
    p = rlib.run_builder("--pins", str(work / "pins.toml"), "hosts", "--json", cwd=work)
    rlib.assert_clean_cli(p)
    assert rlib.snapshot(work) == before


@CLI_FUZZ
@given(data=st.data())
def test_cli_hosts_on_a_misspelt_inventory_key(tmp_path: Path, data: st.DataObject) -> None:
    """`builder hosts`: exit 2, one `error:` line naming the file and the misspelt key, no traceback."""
    work = tmp_path / "proj"
    (work / "hosts").mkdir(parents=True, exist_ok=True)
    (work / "pins.toml").write_bytes(PINS_SEEDS[0])
    doc = _toml_load(data.draw(st.sampled_from(FLEET_SEEDS)))
    parent, key = data.draw(st.sampled_from(_schema_keys(doc, Fleet)))
    typo = _typo(data, key)
    table = _get(doc, parent)
    if typo in known_keys(Fleet, parent) or typo in table:
        return
    table[typo] = table.pop(key)
    f = work / "hosts" / "f.toml"
    f.write_bytes(to_toml(doc))
    before = rlib.snapshot(work)
    p = rlib.run_builder("--pins", str(work / "pins.toml"), "hosts", "--json", cwd=work)
    rlib.assert_clean_cli(p, allowed=(2,))
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    m = assert_unknown_key_form(lines[0][len("error: "):], f)
    assert m is not None and typo in m["key"], p.stderr
    assert rlib.snapshot(work) == before


@CLI_FUZZ
@given(data=st.data())
def test_cli_verify_on_fuzzed_manifests(bundle_dir: tuple[Path, Path], data: st.DataObject) -> None:
    src, pub = bundle_dir
    work = src.parent / "cli-bundle"
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(src, work)
    mgood = (src / MANIFEST).read_bytes()
    new = draw_document(data, [mgood], _json_load, to_json)
    (work / MANIFEST).write_bytes(new)
    before = rlib.snapshot(work)
    p = rlib.run_builder("verify", str(work), "--key", str(pub), cwd=work.parent)
    rlib.assert_clean_cli(p)
    assert (p.returncode == 0) == (new == mgood), p.stderr
    assert rlib.snapshot(work) == before
