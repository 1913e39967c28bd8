"""Provenance of a built image in the ecosystem's formats: a CycloneDX 1.5 SBOM (cyclonedx-python-lib's
model and serializer; each component with its package URL, `purl`, written by packageurl-python) and an
in-toto Statement v1 with a SLSA Provenance v1 predicate, also carried as a DSSE envelope (the form
attestation tools read: cosign, slsa-verifier, in-toto).

Both are pure functions of the plan (the closure: engine source at its commit, each patch, each
toolchain artifact, the base by digest, each file, the recipe's files) and the image record (the
ImageID, the OCI manifest digest, the DiffIDs), so the same build gives the same bytes on any
machine with the same cyclonedx-python-lib release (its serializer lays the SBOM out): no wall-clock
time goes in (the SBOM's timestamp is SOURCE_DATE_EPOCH). They are written to
the store under ``provenance/<input address>/`` at build time; ``builder bundle`` signs them with the
bundle key (minisign, as the manifest), wraps the statement in a DSSE envelope signed with the same key
(``provenance.intoto.jsonl``: one envelope per line, as in-toto's attestation bundles), and carries them
under ``provenance/``; ``builder verify`` checks each signature, that the envelope's payload is the
statement beside it, and that each document names the bundle's image.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder import __version__
from builder.errors import VerifyError
from builder.foundation import sign
from builder.foundation.canon import atomic_write, pretty_json
from builder.lock.plainfiles import scrub_url
from builder.lock.wheelset import sbom_items

if TYPE_CHECKING:  # (types only: checking a bundle's documents needs neither)
    from builder.image.imagerecord import ImageRecord
    from builder.image.plan import Plan

SBOM = "sbom.cdx.json"
STATEMENT = "provenance.intoto.json"
DOCUMENTS = (SBOM, STATEMENT)
#: the statement in a DSSE envelope (in-toto's attestation bundle form: one JSON envelope per line)
ENVELOPE = "provenance.intoto.jsonl"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
SIG_SUFFIX = ".minisig"
BUNDLE_DIR = "provenance"  # the folder of a bundle that carries them

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
SLSA_PROVENANCE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:builder:buildtype:image:v1"
BUILDER_ID = "urn:builder:image"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
# serialNumber: a UUID derived from the input address, so the SBOM stays a function of the build
_NAMESPACE = uuid.UUID("6f2b0f0e-3c5a-4d6e-9b1a-2d4c8e7f9a10")


def _hex(digest: str) -> str:
    return digest.removeprefix("sha256:")


# ---------------------------------------------------------------- package URLs (github.com/package-url/purl-spec)


def purl(ptype: str, name: str, *, namespace: str = "", version: str | None = None,
         qualifiers: dict[str, str] | None = None) -> str:
    """``pkg:type/namespace/name@version?qualifiers`` in canonical form, as packageurl-python (the purl
    spec's reference implementation) writes it: each part percent-encoded, the type's own name rules
    (pypi and github names lower case), qualifiers sorted by key, empty ones left out."""
    from packageurl import PackageURL  # (at first use: only a build writes provenance)

    q = {k: v for k, v in (qualifiers or {}).items() if v}
    return str(PackageURL(type=ptype, namespace=namespace.strip("/") or None, name=name, version=version or None,
                          qualifiers=q or None).to_string())


# a repository on a forge that has its own purl type: https://github.com/OWNER/REPO(.git), or the
# scp-like and ssh:// forms of the same
_FORGE = re.compile(r"^(?:https?://|ssh://(?:[^@/]+@)?|git://|[^@/:]+@)?(?:www\.)?"
                    r"(?P<host>github\.com|gitlab\.com|bitbucket\.org)[:/]"
                    r"(?P<owner>[A-Za-z0-9_.-]+)/(?P<repo>[A-Za-z0-9_.-]+?)(?:\.git)?/?$")
_FORGE_TYPE = {"github.com": "github", "gitlab.com": "gitlab", "bitbucket.org": "bitbucket"}


def source_purl(name: str, url: str, commit: str) -> str:
    """A git source at its commit: ``pkg:github/owner/repo@commit`` (gitlab, bitbucket likewise); any
    other repository ``pkg:generic/NAME@commit`` with its ``vcs_url`` when the url is a URL (a path in
    the project, such as a git bundle, names no place anyone else can fetch from)."""
    m = _FORGE.match(url)
    if m:
        ptype = _FORGE_TYPE[m["host"]]
        return purl(ptype, m["repo"].lower(), namespace=m["owner"].lower(), version=commit)
    shown = scrub_url(url)
    vcs = f"git+{shown}@{commit}" if re.match(r"^[a-z][a-z0-9+.-]*://", shown) else ""
    return purl("generic", name, version=commit, qualifiers={"vcs_url": vcs})


def file_purl(path: str, sha256: str, version: str | None = None) -> str:
    """A file by its content: ``pkg:generic/[folders/]NAME?checksum=sha256:HEX``."""
    folder, _, base = path.strip("/").rpartition("/")
    return purl("generic", base, namespace=folder, version=version, qualifiers={"checksum": f"sha256:{sha256}"})


def _oci_repository(ref: str) -> tuple[str, str]:
    """An image reference's repository, registry included (Docker Hub's defaults filled in), and tag."""
    ref = ref.split("@", 1)[0]
    repo, tag = ref, ""
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        repo, tag = ref.rsplit(":", 1)
    first = repo.split("/", 1)[0]
    if "/" not in repo or not ("." in first or ":" in first or first == "localhost"):
        repo = "docker.io/" + (repo if "/" in repo else "library/" + repo)
    return repo, tag


def oci_purl(ref: str, digest: str, platform: str | None = None, *, registry: bool = True) -> str:
    """An image by digest: ``pkg:oci/NAME@sha256:HEX?arch=..&repository_url=REGISTRY/PATH&tag=..``."""
    repo, tag = _oci_repository(ref)
    arch = platform.split("/")[1] if platform and "/" in platform else ""
    return purl("oci", repo.rsplit("/", 1)[-1].lower(), version=digest.lower(),
                qualifiers={"arch": arch, "repository_url": repo if registry else "", "tag": tag})


def toolchain_purl(name: str, version: str | None, sha256: str | None, package: str | None = None) -> str:
    """A toolchain by version, and by the artifact's checksum when builder fetched one (a toolchain the
    base image carries has none: the base's digest pins its bytes). A wheel is the package index's
    package (``pkg:pypi/ziglang@0.17.0``); any other toolchain is ``pkg:generic/NAME``."""
    return purl("pypi" if package else "generic", package or name, version=version,
                qualifiers={"checksum": f"sha256:{sha256}" if sha256 else ""})


def _dependencies(p: Plan) -> list[dict[str, Any]]:
    """Every locked input of the image as an in-toto ResourceDescriptor, with its digest."""
    c = p.closure
    out: list[dict[str, Any]] = []
    for sname, s in sorted(c["sources"].items()):
        out.append({
            "name": f"sources/{sname}",
            "uri": f"git+{scrub_url(s['url'])}@{s['commit']}",
            "digest": {"gitCommit": s["commit"]},
            "annotations": {"tree_sha256": s["tree_sha256"]},
        })
        for i, patch in enumerate(s["patches"]):
            out.append({
                "name": f"sources/{sname}/patches/{patch['file']}",
                "digest": {"sha256": patch["sha256"]},
                "annotations": {"source": sname, "order": i},
            })
    base = c.get("base")
    for tname, t in sorted(c["toolchains"].items()):
        arts = t.get("artifacts") or {}
        version = str(t.get("version") or "unknown")
        if not arts:
            # a toolchain the base image carries (CUDA): the base's digest is what pins its bytes
            entry: dict[str, Any] = {"name": f"toolchains/{tname}",
                                     "annotations": {"kind": t["kind"], "version": version}}
            if base:
                entry["digest"] = {"sha256": _hex(base["manifest_digest"])}
                entry["annotations"]["provided_by"] = f"bases/{base['ref']}"
            else:
                entry["uri"] = f"urn:builder:toolchain:{tname}:{version}"
            out.append(entry)
        for plat, sha in sorted(arts.items()):
            out.append({"name": f"toolchains/{tname}/{plat}", "digest": {"sha256": sha},
                        "annotations": {"kind": t["kind"], "version": version}})
    if base:
        out.append({"name": f"bases/{base['ref']}", "uri": f"oci://{base['ref'].split('@', 1)[0]}",
                    "digest": {"sha256": _hex(base["manifest_digest"])}, "mediaType": MEDIA_MANIFEST})
    for fname, sha in sorted(c["files"].items()):
        out.append({"name": f"files/{fname}", "digest": {"sha256": sha}})
    for set_name, filename, _, _, sha in sbom_items(c):
        out.append({"name": f"wheels/{set_name}/{filename}", "digest": {"sha256": sha}})
    for rel, sha in sorted(c["recipe"].items()):
        out.append({"name": f"recipe/{p.name}/{rel}", "digest": {"sha256": sha}})
    return out


def _subjects(rec: ImageRecord) -> list[dict[str, Any]]:
    """The image's manifest (where it has one) and its config (the ImageID), each named for itself: the
    image's name at that digest (``NAME@sha256:HEX``), so that no two subjects share a name."""
    repo = rec.tag.rsplit(":", 1)[0]
    out = []
    if rec.manifest_digest:
        out.append({"name": f"{repo}@{rec.manifest_digest}", "digest": {"sha256": _hex(rec.manifest_digest)},
                    "mediaType": MEDIA_MANIFEST})
    out.append({"name": f"{repo}@{rec.image_id}", "digest": {"sha256": _hex(rec.image_id)},
                "mediaType": MEDIA_CONFIG})
    return out


def statement(p: Plan, rec: ImageRecord) -> dict[str, Any]:
    """The in-toto Statement v1 with its SLSA Provenance v1 predicate."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": _subjects(rec),
        "predicateType": SLSA_PROVENANCE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"image": p.name, "platform": p.platform, "lock_hash": p.lock_hash},
                "internalParameters": {"input_address": p.address, "plan": p.closure,
                                       "builder_version": __version__},
                "resolvedDependencies": _dependencies(p),
            },
            "runDetails": {
                "builder": {"id": BUILDER_ID, "version": {"builder": __version__}},
                "metadata": {"invocationId": p.address},
                "byproducts": [{"name": f"diff_ids/{i}", "digest": {"sha256": _hex(d)}}
                               for i, d in enumerate(rec.diff_ids)],
            },
        },
    }


def sbom(p: Plan, rec: ImageRecord) -> dict[str, Any]:
    """The CycloneDX 1.5 SBOM: the image, and each input that went into it, each with its purl; built with
    cyclonedx-python-lib's model and written by its 1.5 JSON serializer (the format's own implementation:
    its field names, enumerations and layout are the library's, which also validates it). Its serial
    number derives from the input address and its timestamp is SOURCE_DATE_EPOCH, so it stays a function
    of the build."""
    # imported at first use: only a build writes an SBOM, and the library is large
    from cyclonedx.model import ExternalReference, ExternalReferenceType, HashAlgorithm, HashType, Property, XsUri
    from cyclonedx.model.bom import Bom, BomMetaData
    from cyclonedx.model.component import Component, ComponentType, Diff, Patch, PatchClassification, Pedigree
    from cyclonedx.output.json import JsonV1Dot5
    from packageurl import PackageURL

    def component(ref: str, ctype: ComponentType, name: str, sha: str | None, *, version: str | None = None,
                  purl_text: str | None = None, props: Iterable[tuple[str, str]] = (), **extra: Any) -> Component:
        return Component(type=ctype, bom_ref=ref, name=name, version=version,
                         hashes=[HashType(alg=HashAlgorithm.SHA_256, content=sha)] if sha else None,
                         purl=PackageURL.from_string(purl_text) if purl_text else None,
                         properties=[Property(name=k, value=v) for k, v in props] or None, **extra)

    c = p.closure
    comps: list[Component] = []
    for sname, s in sorted(c["sources"].items()):
        patches = [Patch(type=PatchClassification.UNOFFICIAL, diff=Diff(url=XsUri(pp["file"]))) for pp in s["patches"]]
        comps.append(component(f"source:{sname}", ComponentType.APPLICATION, sname, None, version=s["commit"],
                               purl_text=source_purl(sname, s["url"], s["commit"]),
                               props=[("io.builder.tree-sha256", s["tree_sha256"])],
                               external_references=[ExternalReference(type=ExternalReferenceType.VCS,
                                                                      url=XsUri(scrub_url(s["url"])))],
                               pedigree=Pedigree(patches=patches) if patches else None))
        for pp in s["patches"]:
            comps.append(component(f"patch:{sname}:{pp['file']}", ComponentType.FILE, pp["file"], pp["sha256"],
                                   purl_text=file_purl(pp["file"], pp["sha256"]),
                                   props=[("io.builder.patch-of", sname)]))
    for tname, t in sorted(c["toolchains"].items()):
        arts = t.get("artifacts") or {}
        art = arts.get(p.platform) or (next(iter(sorted(arts.values()))) if arts else None)
        comps.append(component(f"toolchain:{tname}", ComponentType.APPLICATION, tname, art,
                               version=str(t.get("version") or "unknown"),
                               purl_text=toolchain_purl(tname, t.get("version"), art, t.get("package")),
                               props=[("io.builder.kind", t["kind"]),
                                      *((f"io.builder.artifact.{plat}", sha) for plat, sha in sorted(arts.items()))]))
    base = c.get("base")
    if base:
        comps.append(component("base", ComponentType.CONTAINER, base["ref"].split("@", 1)[0],
                               _hex(base["manifest_digest"]), version=base["manifest_digest"],
                               purl_text=oci_purl(base["ref"], base["manifest_digest"], p.platform)))
    for fname, sha in sorted(c["files"].items()):
        comps.append(component(f"file:{fname}", ComponentType.FILE, fname, sha, purl_text=file_purl(fname, sha)))
    for set_name, filename, wname, version, sha in sbom_items(c):
        comps.append(component(f"wheel:{set_name}:{filename}", ComponentType.LIBRARY, wname, sha, version=version,
                               purl_text=purl("pypi", wname, version=version,
                                              qualifiers={"checksum": f"sha256:{sha}"}),
                               props=[("io.builder.wheel-set", set_name), ("io.builder.filename", filename)]))
    for rel, sha in sorted(c["recipe"].items()):
        path = f"images/{p.name}/{rel}"
        comps.append(component(f"recipe:{rel}", ComponentType.FILE, path, sha, purl_text=file_purl(path, sha)))
    props = [("io.builder.input-address", p.address), ("io.builder.lock-hash", p.lock_hash),
             ("io.builder.image-id", rec.image_id), ("io.builder.platform", p.platform)]
    if rec.manifest_digest:
        props.append(("io.builder.manifest-digest", rec.manifest_digest))
    props += [(f"io.builder.diff-id.{i}", d) for i, d in enumerate(rec.diff_ids)]
    image = component("image", ComponentType.CONTAINER, rec.tag.rsplit(":", 1)[0], _hex(rec.image_id),
                      version=p.address[:32], props=props,
                      # (an image is named by its manifest's digest; a local one has no registry)
                      purl_text=oci_purl(rec.tag, rec.manifest_digest, p.platform, registry=False)
                      if rec.manifest_digest else None)
    bom = Bom(serial_number=uuid.uuid5(_NAMESPACE, p.address), version=1,
              metadata=BomMetaData(timestamp=datetime.fromtimestamp(p.source_date_epoch, UTC), component=image))
    bom.metadata.tools.components.add(Component(type=ComponentType.APPLICATION, name="builder",
                                                version=__version__))
    for comp in comps:
        bom.components.add(comp)
        bom.register_dependency(comp)
    bom.register_dependency(image, comps)
    return json.loads(JsonV1Dot5(bom).output_as_string())  # type: ignore[no-any-return]


def documents(p: Plan, rec: ImageRecord) -> dict[str, bytes]:
    return {SBOM: pretty_json(sbom(p, rec)), STATEMENT: pretty_json(statement(p, rec))}


def folder(store: Path, input_address: str) -> Path:
    return store / "provenance" / input_address


def write(store: Path, p: Plan, rec: ImageRecord) -> Path:
    d = folder(store, p.address)
    for name, data in documents(p, rec).items():
        atomic_write(d / name, data)
    return d


def ensure(store: Path, p: Plan, rec: ImageRecord) -> Path:
    """Write the documents unless the store already holds exactly these bytes."""
    d = folder(store, p.address)
    docs = documents(p, rec)
    if all((d / n).is_file() and (d / n).read_bytes() == data for n, data in docs.items()):
        return d
    return write(store, p, rec)


def read(store: Path, input_address: str) -> dict[str, bytes] | None:
    d = folder(store, input_address)
    if not all((d / n).is_file() for n in DOCUMENTS):
        return None
    return {n: (d / n).read_bytes() for n in DOCUMENTS}


def signed(docs: dict[str, bytes], secret: sign.SecretKey, image_id: str) -> dict[str, bytes]:
    """Each document and its minisign signature (the trusted comment names the image)."""
    out: dict[str, bytes] = {}
    for name, data in sorted(docs.items()):
        out[name] = data
        out[name + SIG_SUFFIX] = sign.sign(data, secret, f"builder provenance {name} {image_id}").encode()
    return out


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1's pre-authentication encoding: what the envelope's signatures sign."""
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %b %d %b" % (len(t), t, len(payload), payload)


def envelope(payload: bytes, secret: sign.SecretKey) -> bytes:
    """The statement in a DSSE envelope, signed (Ed25519 over the PAE) with the bundle key; its keyid is
    the key's minisign id. One line of JSON and a newline: an in-toto attestation bundle of one."""
    sig = sign.sign_raw(pae(PAYLOAD_TYPE, payload), secret)
    env = {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(payload).decode("ascii"),
           "signatures": [{"keyid": secret.public_key.key_id_hex, "sig": base64.b64encode(sig).decode("ascii")}]}
    return (json.dumps(env, separators=(",", ":"), sort_keys=True) + "\n").encode("ascii")


def _b64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise VerifyError(f"{what}: not base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise VerifyError(f"{what}: not base64 text") from None


def open_envelope(data: bytes, key: sign.PublicKey, where: str) -> bytes:
    """A DSSE envelope's payload, once a signature by ``key`` over its PAE checks (a signature naming
    another keyid is passed over; DSSE's keyid is a hint). One-line VerifyError otherwise."""
    lines = [ln for ln in data.splitlines() if ln.strip()]
    if len(lines) != 1:
        raise VerifyError(f"{where}: expected one DSSE envelope (one line of JSON), found {len(lines)} lines")
    try:
        env = json.loads(lines[0])
    except (ValueError, RecursionError):
        raise VerifyError(f"{where}: not JSON") from None
    if not isinstance(env, dict) or env.get("payloadType") != PAYLOAD_TYPE:
        raise VerifyError(f"{where}: not a DSSE envelope of payload type {PAYLOAD_TYPE}")
    payload = _b64(env.get("payload"), f"{where}: payload")
    sigs = env.get("signatures")
    if not isinstance(sigs, list) or not sigs:
        raise VerifyError(f"{where}: no signatures")
    message = pae(PAYLOAD_TYPE, payload)
    tried = 0
    for s in sigs:
        if not isinstance(s, dict) or s.get("keyid", key.key_id_hex) != key.key_id_hex:
            continue
        tried += 1
        try:
            sign.verify_raw(message, _b64(s.get("sig"), f"{where}: sig"), key, source=where)
        except VerifyError:
            continue
        return payload
    if not tried:
        raise VerifyError(f"{where}: no signature by key {key.key_id_hex}")
    raise VerifyError(f"{where}: signature verification failed: the payload does not match its signature")


def check_documents(docs: dict[str, bytes], image: dict[str, Any], where: str) -> None:
    """Each document names this image: the statement's subject (config digest) and the SBOM's image hash
    are the ImageID, and the DiffIDs are the manifest's. VerifyError naming the document otherwise."""
    image_hex = _hex(str(image["image_id"]))
    try:
        st = json.loads(docs[STATEMENT])
        bom = json.loads(docs[SBOM])
    except (KeyError, ValueError) as e:
        raise VerifyError(f"{where}: provenance document missing or not JSON: {e}") from None
    if st.get("_type") != STATEMENT_TYPE or st.get("predicateType") != SLSA_PROVENANCE:
        raise VerifyError(f"{where}/{STATEMENT}: not an in-toto Statement v1 with a SLSA Provenance v1 predicate")
    subjects = [s.get("digest", {}).get("sha256") for s in st.get("subject") or [] if isinstance(s, dict)]
    if image_hex not in subjects:
        raise VerifyError(f"{where}/{STATEMENT}: no subject is image {image['image_id']}")
    byproducts = (st.get("predicate") or {}).get("runDetails", {}).get("byproducts") or []
    diff_ids = ["sha256:" + str(b.get("digest", {}).get("sha256")) for b in byproducts
                if str(b.get("name", "")).startswith("diff_ids/")]
    if diff_ids != list(image["diff_ids"]):
        raise VerifyError(f"{where}/{STATEMENT}: its DiffIDs are not the image's")
    comp = (bom.get("metadata") or {}).get("component") or {}
    hashes = [h.get("content") for h in comp.get("hashes") or []]
    if bom.get("bomFormat") != "CycloneDX" or image_hex not in hashes:
        raise VerifyError(f"{where}/{SBOM}: the SBOM does not describe image {image['image_id']}")


def verify_bundle_docs(bundle_dir: Path, image: dict[str, Any], key_text: bytes) -> list[str]:
    """The signed documents a bundle carries, checked: signature (the bundle key) and subject, and the DSSE
    envelope (its signature, and its payload the statement beside it) when the bundle carries one (its
    signed manifest says whether it does). Returns the names checked ([] when the bundle carries none)."""
    d = bundle_dir / BUNDLE_DIR
    if not d.is_dir():
        return []
    docs: dict[str, bytes] = {}
    for name in DOCUMENTS:
        f, s = d / name, d / (name + SIG_SUFFIX)
        if not f.is_file() or not s.is_file():
            raise VerifyError(f"{d}: {name} or its signature is missing")
        data = f.read_bytes()
        sign.verify(data, s.read_bytes(), key_text, source=f"{BUNDLE_DIR}/{name}{SIG_SUFFIX}")
        docs[name] = data
    check_documents(docs, image, str(d))
    checked = sorted(docs)
    env = d / ENVELOPE
    if env.is_file():
        where = f"{BUNDLE_DIR}/{ENVELOPE}"
        payload = open_envelope(env.read_bytes(), sign.parse_public_key(key_text), where)
        if payload != docs[STATEMENT]:
            raise VerifyError(f"{where}: its payload is not {BUNDLE_DIR}/{STATEMENT}")
        checked.append(ENVELOPE)
    return sorted(checked)


def bundle_files(store: Path, rec: ImageRecord, secret: sign.SecretKey) -> dict[str, bytes]:
    """The files a bundle carries for its image's provenance (``provenance/NAME`` and its signature, and
    the statement's DSSE envelope); {} when the store holds none for this image (a record from before
    provenance: `builder image` writes them)."""
    docs = read(store, rec.input_address)
    if docs is None:
        return {}
    files = signed(docs, secret, rec.image_id)
    files[ENVELOPE] = envelope(docs[STATEMENT], secret)
    return {f"{BUNDLE_DIR}/{name}": data for name, data in sorted(files.items())}
