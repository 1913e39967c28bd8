"""Provenance documents (builder/image/provenance.py), each checked by its format's own validator from PyPI:
the SBOM by cyclonedx-python-lib's strict JSON-schema validator (CycloneDX 1.5) and each component's purl
by packageurl-python (the purl spec's reference parser), the in-toto Statement by in-toto-attestation's
protobuf bindings (the Statement v1 and SLSA Provenance v1 messages: unknown fields and wrong types are
refused by the parser, then the Statement's own validate()), and its DSSE envelope by securesystemslib's
DSSE implementation (Envelope.verify with an Ed25519 key). No Docker: the plan is the shipped lock's, the
record one a build would write."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator
from google.protobuf import json_format
from in_toto_attestation.predicates.provenance.v1 import provenance_pb2
from in_toto_attestation.v1 import statement_pb2
from in_toto_attestation.v1.resource_descriptor import ResourceDescriptor
from in_toto_attestation.v1.statement import Statement
from packageurl import PackageURL
from securesystemslib.dsse import Envelope
from securesystemslib.exceptions import VerificationError
from securesystemslib.signer import CryptoSigner, SSlibKey

from builder.bundle import BundleOptions, load_bundle_inputs, make_bundle
from builder.errors import VerifyError
from builder.foundation import sign
from builder.image import provenance
from builder.image.imagerecord import ImageRecord, read_record, tag_for
from builder.image.plan import Plan
from builder.image.plan import make_plan as plan_of
from builder.image.plan import plan as make_plan
from builder.inputs.pins import load_pins
from builder.lock.lockfile import load_lock
from tests.lib import bundlelib as bl

ROOT = Path(__file__).resolve().parent.parent
H = "sha256:" + "ab" * 32


def _plan(name: str = "demo") -> Plan:
    return make_plan(ROOT / "pins.toml", ROOT / "pins.lock", name)


def _record(p: Plan) -> ImageRecord:
    return ImageRecord(name=p.name, input_address=p.address, image_id="sha256:" + "1" * 64,
                       diff_ids=["sha256:" + "2" * 64, "sha256:" + "3" * 64], tag=tag_for(p.name, p.address),
                       lock_hash=p.lock_hash, platform=p.platform, source_date_epoch=p.source_date_epoch,
                       manifest_digest="sha256:" + "4" * 64, config_size=900, layer_sizes=[10, 20])


def _cyclonedx_errors(data: bytes) -> str | None:
    err = JsonStrictValidator(SchemaVersion.V1_5).validate_str(data.decode())
    return None if err is None else str(err.data.message)


def _intoto_check(data: bytes) -> None:
    """Parse with the official bindings (strict: unknown fields raise) and validate()."""
    doc = json.loads(data)
    st = Statement.copy_from_pb(json_format.Parse(data, statement_pb2.Statement()))
    st.validate()
    assert st.pb.predicate_type == "https://slsa.dev/provenance/v1"
    pred = json_format.ParseDict(doc["predicate"], provenance_pb2.Provenance())
    bd = pred.build_definition
    assert bd.build_type and pred.run_details.builder.id  # SLSA v1's required fields
    assert len(bd.resolved_dependencies) > 0
    for rd in bd.resolved_dependencies:
        ResourceDescriptor.copy_from_pb(rd).validate()
        assert len(rd.digest) > 0, rd.name  # every locked input with its digest


def _with_base() -> Plan:
    """The demo plan with a GB10-style base by digest and a CUDA toolchain (the shipped lock locks only
    the demo lane offline; the seed lanes' bases need the network)."""
    p = _plan()
    closure = {**p.closure, "platform": "linux/arm64",
               "base": {"ref": "nvcr.io/nvidia/pytorch:26.07-py3", "manifest_digest": H},
               "toolchains": {**p.closure["toolchains"], "cuda": {"kind": "cuda", "version": None, "artifacts": {}}}}
    return Plan(name="tensorfold", closure=closure, address="c" * 64, lock_hash="d" * 64)


@pytest.mark.parametrize("which", ["demo", "with-base"])
def test_documents_pass_their_validators(which: str) -> None:
    p = _plan() if which == "demo" else _with_base()
    docs = provenance.documents(p, _record(p))
    assert _cyclonedx_errors(docs[provenance.SBOM]) is None
    _intoto_check(docs[provenance.STATEMENT])


@pytest.mark.parametrize("which", ["demo", "with-base"])
def test_the_sbom_reads_back_into_cyclonedx_python_libs_model(which: str) -> None:
    """The SBOM's bytes read back into cyclonedx-python-lib's model (Bom.from_json) and written again by
    its serializer give the same document: nothing in it is outside the library's model."""
    from cyclonedx.model.bom import Bom
    from cyclonedx.output.json import JsonV1Dot5

    p = _plan() if which == "demo" else _with_base()
    doc = json.loads(provenance.documents(p, _record(p))[provenance.SBOM])
    bom = Bom.from_json(doc)  # type: ignore[attr-defined]
    assert bom.metadata.component is not None and bom.metadata.component.bom_ref.value == "image"
    assert {c.bom_ref.value for c in bom.components} == {c["bom-ref"] for c in doc["components"]}
    assert json.loads(JsonV1Dot5(bom).output_as_string()) == doc
    assert _cyclonedx_errors(JsonV1Dot5(bom).output_as_string().encode()) is None


def test_the_validators_refuse_a_broken_document() -> None:
    """The validators are not lenient: a wrong field is caught by each."""
    p = _plan()
    bom = provenance.sbom(p, _record(p))
    bom["components"][0]["type"] = "engine"
    assert _cyclonedx_errors(json.dumps(bom).encode()) is not None
    st = provenance.statement(p, _record(p))
    st["predicate"]["buildDefinition"]["resolvedDependencies"][0]["digests"] = {}
    with pytest.raises(json_format.ParseError):
        _intoto_check(json.dumps(st).encode())


def test_the_documents_name_every_input() -> None:
    p = _plan()
    rec = _record(p)
    st = provenance.statement(p, rec)
    deps = {d["name"]: d for d in st["predicate"]["buildDefinition"]["resolvedDependencies"]}
    src = p.closure["sources"]["demo-engine"]
    assert deps["sources/demo-engine"]["digest"] == {"gitCommit": src["commit"]}
    for patch in src["patches"]:
        assert deps[f"sources/demo-engine/patches/{patch['file']}"]["digest"] == {"sha256": patch["sha256"]}
    for plat, sha in p.closure["toolchains"]["zig-wheel"]["artifacts"].items():
        assert deps[f"toolchains/zig-wheel/{plat}"]["digest"] == {"sha256": sha}
    assert deps["files/demo-chat-template"]["digest"]["sha256"] == p.closure["files"]["demo-chat-template"]
    assert {s["digest"]["sha256"] for s in st["subject"]} == {"1" * 64, "4" * 64}
    assert st["predicate"]["buildDefinition"]["internalParameters"]["plan"] == p.closure
    bom = provenance.sbom(p, rec)
    names = {c["name"] for c in bom["components"]}
    assert {"demo-engine", "zig-wheel", "demo-chat-template"} <= names
    assert bom["metadata"]["component"]["hashes"][0]["content"] == "1" * 64


def test_documents_are_a_function_of_the_build() -> None:
    p = _plan()
    assert provenance.documents(p, _record(p)) == provenance.documents(_plan(), _record(p))


def test_base_by_digest_is_a_dependency() -> None:
    p = _with_base()
    deps = provenance.statement(p, _record(p))["predicate"]["buildDefinition"]["resolvedDependencies"]
    base = [d for d in deps if d["name"].startswith("bases/")]
    assert base and base[0]["digest"]["sha256"] == H.removeprefix("sha256:")
    comps = provenance.sbom(p, _record(p))["components"]
    assert [c for c in comps if c["type"] == "container"][0]["version"] == H


def test_signed_documents_verify_and_tampering_is_named(tmp_path: Path) -> None:
    p = _plan()
    rec = _record(p)
    provenance.write(tmp_path / "store", p, rec)
    sign.generate_keypair(tmp_path / "k.key", tmp_path / "k.pub")
    secret = sign.load_secret_key(tmp_path / "k.key")
    files = provenance.bundle_files(tmp_path / "store", rec, secret)
    bundle = tmp_path / "bundle"
    for rel, data in files.items():
        (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
        (bundle / rel).write_bytes(data)
    image = {"image_id": rec.image_id, "diff_ids": rec.diff_ids}
    key = (tmp_path / "k.pub").read_bytes()
    assert provenance.verify_bundle_docs(bundle, image, key) == sorted([*provenance.DOCUMENTS, provenance.ENVELOPE])
    with pytest.raises(VerifyError, match="no subject is image"):
        provenance.verify_bundle_docs(bundle, {**image, "image_id": H}, key)
    st = bundle / provenance.BUNDLE_DIR / provenance.STATEMENT
    st.write_bytes(st.read_bytes().replace(b"demo-engine", b"demo-engino"))
    with pytest.raises(VerifyError, match=r"provenance/provenance.intoto.json.minisig"):
        provenance.verify_bundle_docs(bundle, image, key)


def test_ensure_writes_once(tmp_path: Path) -> None:
    p = _plan()
    d = provenance.ensure(tmp_path, p, _record(p))
    mtime = (d / provenance.SBOM).stat().st_mtime_ns
    provenance.ensure(tmp_path, p, _record(p))
    assert (d / provenance.SBOM).stat().st_mtime_ns == mtime
    assert provenance.read(tmp_path, p.address) is not None


# --------------------------------------------------------------------------- package URLs


def _purls(bom: dict) -> dict[str, str]:  # type: ignore[type-arg]
    comps = [bom["metadata"]["component"], *bom["components"]]
    return {c["bom-ref"]: c["purl"] for c in comps if "purl" in c}


@pytest.mark.parametrize("which", ["demo", "with-base"])
def test_every_sbom_component_has_a_canonical_purl(which: str) -> None:
    """Each component's purl parses with packageurl-python, is already in its canonical form, and says what
    the component's hash says."""
    p = _plan() if which == "demo" else _with_base()
    bom = provenance.sbom(p, _record(p))
    purls = _purls(bom)
    assert set(purls) == {c["bom-ref"] for c in [bom["metadata"]["component"], *bom["components"]]}
    for c in [bom["metadata"]["component"], *bom["components"]]:
        u = PackageURL.from_string(c["purl"])
        assert u.to_string() == c["purl"], c["purl"]
        if c["type"] == "file":
            assert u.type == "generic"
            assert u.qualifiers == {"checksum": "sha256:" + c["hashes"][0]["content"]}
    src = PackageURL.from_string(purls["source:demo-engine"])
    # the demo engine comes from a git bundle in the project: no URL anyone else can fetch, so no vcs_url
    assert (src.type, src.name, src.version, src.qualifiers) == (
        "generic", "demo-engine", p.closure["sources"]["demo-engine"]["commit"], {})
    art = p.closure["toolchains"]["zig-wheel"]["artifacts"][p.platform]
    assert purls["toolchain:zig-wheel"] == f"pkg:pypi/ziglang@0.17.0?checksum=sha256:{art}"
    assert purls["recipe:Dockerfile"].startswith(f"pkg:generic/images/{p.name}/Dockerfile?checksum=sha256:")
    arch = p.platform.split("/")[1]
    assert purls["image"] == f"pkg:oci/{p.name}@sha256:{'4' * 64}?arch={arch}&tag={p.address[:32]}"
    assert _cyclonedx_errors(provenance.documents(p, _record(p))[provenance.SBOM]) is None
    if which == "with-base":
        assert purls["base"] == (f"pkg:oci/pytorch@{H}?arch=arm64&repository_url=nvcr.io/nvidia/pytorch"
                                 "&tag=26.07-py3")
        assert purls["toolchain:cuda"] == "pkg:generic/cuda"


def _strings(doc: object) -> list[str]:
    """Every string anywhere in a JSON document."""
    if isinstance(doc, str):
        return [doc]
    if isinstance(doc, dict):
        return [x for k, v in doc.items() for x in (*_strings(k), *_strings(v))]
    if isinstance(doc, list):
        return [x for v in doc for x in _strings(v)]
    return []


@pytest.mark.parametrize("which", ["demo", "with-base"])
def test_every_purl_of_the_documents_parses_and_the_subjects_are_distinct(which: str) -> None:
    """Every package URL anywhere in the built documents (the bytes written to the store) parses with
    packageurl-python and is already its canonical form; the wheel is PyPI's package; no two subjects of
    the statement share a name, and each names its own digest."""
    p = _plan() if which == "demo" else _with_base()
    docs = provenance.documents(p, _record(p))
    found = [x for name in provenance.DOCUMENTS for x in _strings(json.loads(docs[name])) if x.startswith("pkg:")]
    bom = json.loads(docs[provenance.SBOM])
    assert len(found) >= len(bom["components"]) + 1
    parsed = [PackageURL.from_string(x) for x in found]
    assert [u.to_string() for u in parsed] == found
    wheels = [u for u in parsed if u.type == "pypi"]
    assert [(u.name, u.version) for u in wheels] == [("ziglang", "0.17.0")]
    assert not [u for u in parsed if u.type == "generic" and u.name in ("zig-wheel", "ziglang")]
    subjects = json.loads(docs[provenance.STATEMENT])["subject"]
    names = [s["name"] for s in subjects]
    assert len(names) == len(set(names)) == 2
    for s in subjects:
        assert s["name"].endswith("@sha256:" + s["digest"]["sha256"]), s
    # a record with no manifest (a local build never pushed): one subject, named for the ImageID
    rec = _record(p).model_copy(update={"manifest_digest": None})
    [only] = provenance.statement(p, rec)["subject"]
    assert only["name"] == f"{rec.tag.rsplit(':', 1)[0]}@{rec.image_id}"


@pytest.mark.parametrize(("url", "want"), [
    ("https://github.com/bertholomus/TensorFold.git", "pkg:github/bertholomus/tensorfold@{c}"),
    ("https://github.com/vllm-project/vllm", "pkg:github/vllm-project/vllm@{c}"),
    ("git@github.com:flashinfer-ai/flashinfer.git", "pkg:github/flashinfer-ai/flashinfer@{c}"),
    ("https://gitlab.com/org/repo.git", "pkg:gitlab/org/repo@{c}"),
    ("https://tok:secret@git.example.org/a/b.git?x=1",
     "pkg:generic/eng@{c}?vcs_url=git%2Bhttps://git.example.org/a/b.git%40{c}"),
    ("file:///srv/git/eng.git", "pkg:generic/eng@{c}?vcs_url=git%2Bfile:///srv/git/eng.git%40{c}"),
    ("engine-src/demo-engine.bundle", "pkg:generic/eng@{c}"),
])
def test_source_purls(url: str, want: str) -> None:
    c = "0123456789abcdef0123456789abcdef01234567"
    got = provenance.source_purl("eng", url, c)
    assert got == want.format(c=c) and "secret" not in got
    assert PackageURL.from_string(got).to_string() == got


@pytest.mark.parametrize(("ref", "repo", "tag"), [
    ("nvcr.io/nvidia/pytorch:26.07-py3", "nvcr.io/nvidia/pytorch", "26.07-py3"),
    ("docker.io/vllm/vllm-openai:nightly-8a7@sha256:" + "a" * 64, "docker.io/vllm/vllm-openai", "nightly-8a7"),
    ("debian:bookworm", "docker.io/library/debian", "bookworm"),
    ("ghcr.io/o/r", "ghcr.io/o/r", ""),
    ("localhost:5000/builder/demo:1", "localhost:5000/builder/demo", "1"),
])
def test_oci_purls(ref: str, repo: str, tag: str) -> None:
    u = PackageURL.from_string(provenance.oci_purl(ref, H, "linux/arm64"))
    assert (u.type, u.name, u.version) == ("oci", repo.rsplit("/", 1)[-1], H)
    assert u.qualifiers == {"arch": "arm64", "repository_url": repo, **({"tag": tag} if tag else {})}


# --------------------------------------------------------------------------- the DSSE envelope


def _bundle_with_provenance(tmp_path: Path) -> tuple[Path, dict, bytes, sign.SecretKey]:  # type: ignore[type-arg]
    p = _plan()
    rec = _record(p)
    provenance.write(tmp_path / "store", p, rec)
    sign.generate_keypair(tmp_path / "k.key", tmp_path / "k.pub")
    secret = sign.load_secret_key(tmp_path / "k.key")
    bundle = tmp_path / "bundle"
    for rel, data in provenance.bundle_files(tmp_path / "store", rec, secret).items():
        (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
        (bundle / rel).write_bytes(data)
    return bundle, {"image_id": rec.image_id, "diff_ids": rec.diff_ids}, (tmp_path / "k.pub").read_bytes(), secret


def _sslib_verify(envelope_line: bytes, public: sign.PublicKey) -> bytes:
    """securesystemslib's DSSE: parse the envelope, verify it with the Ed25519 public key (threshold 1),
    return the payload."""
    key = SSlibKey(keyid=public.key_id_hex, keytype="ed25519", scheme="ed25519",
                   keyval={"public": public.key.hex()})
    env = Envelope.from_dict(json.loads(envelope_line))
    assert env.payload_type == "application/vnd.in-toto+json"
    assert set(env.verify([key], 1)) == {public.key_id_hex}
    return env.payload


def test_the_dsse_envelope_verifies_with_securesystemslib(tmp_path: Path) -> None:
    bundle, _, _, secret = _bundle_with_provenance(tmp_path)
    d = bundle / provenance.BUNDLE_DIR
    data = (d / provenance.ENVELOPE).read_bytes()
    assert data.endswith(b"\n") and data.count(b"\n") == 1  # one envelope per line (.intoto.jsonl)
    payload = _sslib_verify(data, secret.public_key)
    assert payload == (d / provenance.STATEMENT).read_bytes()
    _intoto_check(payload)  # the payload is the Statement, as in-toto's bindings read it
    assert data == provenance.envelope(payload, secret)  # (Ed25519 is deterministic: same bytes each time)
    # a tampered payload (the signature kept) fails securesystemslib's verification
    env = json.loads(data)
    env["payload"] = base64.b64encode(payload.replace(b"demo-engine", b"demo-engino")).decode()
    with pytest.raises(VerificationError):
        _sslib_verify(json.dumps(env).encode(), secret.public_key)
    # and so does a changed payload type (the PAE covers it), and another key
    env = json.loads(data)
    other = sign.SecretKey(key_id=secret.key_id, seed=b"\x01" * 32, public=sign._public_from_seed(b"\x01" * 32))
    with pytest.raises(VerificationError):
        _sslib_verify(data, other.public_key)
    env["payloadType"] = "application/json"
    key = SSlibKey(keyid=secret.public_key.key_id_hex, keytype="ed25519", scheme="ed25519",
                   keyval={"public": secret.public.hex()})
    with pytest.raises(VerificationError):
        Envelope.from_dict(env).verify([key], 1)


def test_an_envelope_securesystemslib_signs_opens_here(tmp_path: Path) -> None:
    """The other way round: an envelope signed by securesystemslib's own signer, with the bundle key,
    is opened by builder's check (the two implementations agree on PAE and encoding)."""
    sign.generate_keypair(tmp_path / "k.key", tmp_path / "k.pub")
    secret = sign.load_secret_key(tmp_path / "k.key")
    signer = CryptoSigner(Ed25519PrivateKey.from_private_bytes(secret.seed))
    signer.public_key.keyid = secret.public_key.key_id_hex
    env = Envelope(b'{"_type": "x"}', provenance.PAYLOAD_TYPE, {})
    env.sign(signer)
    line = json.dumps(env.to_dict()).encode()
    assert provenance.open_envelope(line, secret.public_key, "e") == b'{"_type": "x"}'


def test_builder_verify_checks_the_envelope(tmp_path: Path) -> None:
    bundle, image, key, secret = _bundle_with_provenance(tmp_path)
    d = bundle / provenance.BUNDLE_DIR
    good = (d / provenance.ENVELOPE).read_bytes()
    env = json.loads(good)

    def refused(doc: object, match: str) -> None:
        (d / provenance.ENVELOPE).write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
        with pytest.raises(VerifyError, match=match) as e:
            provenance.verify_bundle_docs(bundle, image, key)
        assert "\n" not in str(e.value) and str(e.value).startswith("provenance/provenance.intoto.jsonl: ")

    payload = base64.b64decode(env["payload"])
    refused({**env, "payload": base64.b64encode(payload + b" ").decode()}, "payload does not match its signature")
    refused({**env, "payloadType": "text/plain"}, "not a DSSE envelope of payload type")
    refused({**env, "signatures": [{**env["signatures"][0], "keyid": "0" * 16}]}, "no signature by key")
    refused({**env, "signatures": []}, "no signatures")
    refused({**env, "payload": "%%%"}, "payload: not base64")
    refused(b"{", "not JSON")
    refused(good + good, "expected one DSSE envelope")
    # an envelope that verifies but carries another statement than the one beside it
    other = payload.replace(b"demo-engine", b"demo-engino")
    refused(provenance.envelope(other, secret), "its payload is not provenance/provenance.intoto.json")
    (d / provenance.ENVELOPE).write_bytes(good)
    assert provenance.ENVELOPE in provenance.verify_bundle_docs(bundle, image, key)


def test_a_rendered_bundle_carries_the_envelope_and_builder_verify_checks_it(tmp_path: Path) -> None:
    """`builder bundle` on a project whose store holds its image's provenance: the bundle carries the
    envelope, `builder verify` passes, and the envelope verifies with securesystemslib on its own."""
    proj = bl.make_project(tmp_path)
    p = plan_of(load_pins(proj.pins), load_lock(proj.root / "pins.lock"), "tiny", proj.root)
    rec = read_record(proj.store, p.address)
    assert rec is not None
    provenance.write(proj.store, p, rec)
    ctx = load_bundle_inputs(proj.pins, proj.root / "pins.lock", proj.store)
    out = make_bundle(ctx, "spark-b", BundleOptions(key=proj.key, out=tmp_path / "b")).path
    manifest = json.loads((out / "manifest.json").read_bytes())
    assert f"provenance/{provenance.ENVELOPE}" in {f["path"] for f in manifest["files"]}
    r = proj.cli("verify", str(out), "--key", str(proj.pub))
    assert r.returncode == 0, r.stderr
    payload = _sslib_verify((out / "provenance" / provenance.ENVELOPE).read_bytes(),
                            sign.load_public_key(proj.pub))
    assert json.loads(payload)["subject"][-1]["digest"]["sha256"] == rec.image_id.removeprefix("sha256:")
