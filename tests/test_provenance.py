"""Provenance documents (builder/provenance.py), each checked by its format's own validator from PyPI:
the SBOM by cyclonedx-python-lib's strict JSON-schema validator (CycloneDX 1.5), the in-toto Statement
by in-toto-attestation's protobuf bindings (the Statement v1 and SLSA Provenance v1 messages: unknown
fields and wrong types are refused by the parser, then the Statement's own validate()). No Docker: the
plan is the shipped lock's, the record one a build would write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder import provenance, sign
from builder.errors import VerifyError
from builder.imagerecord import ImageRecord, tag_for
from builder.plan import Plan
from builder.plan import plan as make_plan

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
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    err = JsonStrictValidator(SchemaVersion.V1_5).validate_str(data.decode())
    return None if err is None else str(err.data.message)


def _intoto_check(data: bytes) -> None:
    """Parse with the official bindings (strict: unknown fields raise) and validate()."""
    from google.protobuf import json_format
    from in_toto_attestation.predicates.provenance.v1 import provenance_pb2
    from in_toto_attestation.v1 import statement_pb2
    from in_toto_attestation.v1.resource_descriptor import ResourceDescriptor
    from in_toto_attestation.v1.statement import Statement

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


def test_the_validators_refuse_a_broken_document() -> None:
    """The validators are not lenient: a wrong field is caught by each."""
    from google.protobuf import json_format

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
    assert provenance.verify_bundle_docs(bundle, image, key) == sorted(provenance.DOCUMENTS)
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
