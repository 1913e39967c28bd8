"""The pins.toml schema: every input a lane needs, named once.

pydantic models are the only schema; unknown keys are refused everywhere. Load with
`load_pins(path)`, which turns any error into one line naming the file and the key path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from builder.errors import ConfigError
from builder.inputs.lanes import Lane
from builder.inputs.loader import did_you_mean, read_toml, validate
from builder.inputs.schema import Digest, Name, Platform, Sha256, Strict
from builder.inputs.wheelpin import WheelSet

#: a value no public source gives: pins.toml says so, and `builder lock` names it instead of guessing
UNKNOWN = "UNKNOWN"

REV_RE = r"^[0-9a-f]{7,40}$"
#: the kinds of input a lock resolves, in the order it resolves them (a kit after the source it comes from)
INPUT_KINDS = ("sources", "toolchains", "bases", "models", "files", "kits", "wheels")
#: every section of pins.toml that names things (and of the lock, which has an entry per name)
SECTIONS = (*INPUT_KINDS, "images", "lanes")


class Patch(Strict):
    """One patch of an ordered series: a file in this repo and why it is there."""

    file: str = Field(min_length=1)
    reason: str = Field(min_length=1)

    @field_validator("file")
    @classmethod
    def _relative(cls, v: str) -> str:
        if v.startswith("/") or ".." in Path(v).parts:
            raise ValueError("must be a path inside the project (relative, no '..')")
        return v

    @field_validator("reason")
    @classmethod
    def _one_line(cls, v: str) -> str:
        if "\n" in v.strip():
            raise ValueError("must be one line")
        return v.strip()


class GitSource(Strict):
    """An engine (or any) git source: a ref to follow, an optional pinned rev, a patch series.
    ``rev = "UNKNOWN"`` records a commit nobody has published in full (the lock names it)."""

    url: str = Field(min_length=1)
    ref: str = Field(min_length=1, description="branch or tag the rev must be on")
    rev: Annotated[str, Field(pattern=REV_RE)] | Literal["UNKNOWN"] | None = None
    patches: list[Patch] = []
    note: str | None = None


class ZigPlatform(Strict):
    url: str = Field(min_length=1)
    sha256: Sha256
    size: int | None = Field(default=None, ge=0)


class ZigToolchain(Strict):
    kind: Literal["zig"]
    version: Annotated[str, Field(pattern=r"^\d+\.\d+\.\d+$")]
    platforms: dict[Platform, ZigPlatform] = Field(min_length=1)


class CudaToolchain(Strict):
    """The CUDA version the image must report (`nvcc --version`); None while nobody has published it."""

    kind: Literal["cuda"]
    version: Annotated[str, Field(pattern=r"^\d+\.\d+(\.\d+)?$")] | None = None
    note: str | None = None


class WheelFile(Strict):
    filename: str = Field(pattern=r"^[A-Za-z0-9_.+-]+\.whl$")
    sha256: Sha256
    url: str | None = None


class WheelToolchain(Strict):
    """A Python wheel by name and version, one file (and sha256) per platform."""

    kind: Literal["wheel"]
    package: str = Field(min_length=1)
    version: str = Field(min_length=1)
    platforms: dict[Platform, WheelFile] = Field(min_length=1)


Toolchain = Annotated[ZigToolchain | CudaToolchain | WheelToolchain, Field(discriminator="kind")]


class BaseImage(Strict):
    """A base image by tag; the lock adds the index digest and each platform's manifest digest.

    `platform_digests` are digests already published (the lock must agree with them).
    `ref = "scratch"` means no base.
    """

    ref: str = Field(min_length=1)
    platforms: list[Platform] = Field(min_length=1)
    digest: Digest | None = None
    platform_digests: dict[Platform, Digest] = {}
    note: str | None = None

    @model_validator(mode="after")
    def _known_platforms(self) -> BaseImage:
        extra = set(self.platform_digests) - set(self.platforms)
        if extra:
            raise ValueError(f"platform_digests names platforms not in platforms: {sorted(extra)}")
        return self


class HfModel(Strict):
    """A Hugging Face model repo at a revision, narrowed by include/exclude globs.

    `local` (a snapshot folder or an HF cache folder, relative to the project or absolute)
    lets the lock hash files already on disk instead of asking the Hub.
    """

    repo: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
    revision: str = Field(min_length=1, description="a branch, tag or 40-hex commit")
    include: list[str] = []
    exclude: list[str] = []
    local: str | None = None
    expect_files: int | None = Field(default=None, ge=1, description="e.g. the shard count")
    role: Literal["weights", "engram", "tokenizer", "other"] = "weights"
    note: str | None = None


class PlainFile(Strict):
    """A plain file by URL (https://, file://, or a path inside the project) and its sha256
    (either may be UNKNOWN while nobody has published it: the lock then names it)."""

    url: str = Field(min_length=1)
    sha256: Sha256 | Literal["UNKNOWN"]
    size: int | None = Field(default=None, ge=0)
    note: str | None = None


class ImageRecipe(Strict):
    recipe: str = Field(min_length=1, description="folder under images/")
    base: Name | None = None
    sources: list[Name] = []
    toolchains: list[Name] = []
    files: list[Name] = []
    #: the wheel sets ([wheels]) whose wheels the build context holds at wheels/. Not in the pin's dump (so
    #: not in its spec hash): the image's lock entry holds nothing of them; its closure (the input address)
    #: and the lock's check of that closure do, and an image without any keeps the hash it always had.
    wheels: list[Name] = Field(default=[], exclude=True)
    build_args: dict[str, str] = {}
    platform: Platform = "linux/arm64"
    note: str | None = None

    @field_validator("recipe")
    @classmethod
    def _in_images(cls, v: str) -> str:
        p = Path(v)
        if p.is_absolute() or ".." in p.parts or not v.startswith("images/"):
            raise ValueError("must be a folder under images/")
        return v


PUBLISHED_RE = re.compile(r"^[^@\s]+@(sha256:[0-9a-f]{64}|UNKNOWN)$")


class PublishedImage(Strict):
    """A published image run as it is, named by digest (``registry/repo@sha256:...``): nothing is built.
    ``registry/repo@UNKNOWN`` records a published image whose digest nobody has given (the lock names it).

    The lock records its manifest digest, its config digest (the ImageID) and its DiffIDs; `builder
    image` pulls it by digest and checks them. A tag alone is refused: it can move under the lock.
    """

    published: str = Field(min_length=1)
    platform: Platform = "linux/arm64"
    note: str | None = None

    @field_validator("published")
    @classmethod
    def _by_digest(cls, v: str) -> str:
        if not PUBLISHED_RE.fullmatch(v):
            if "@" not in v:
                raise ValueError(f"{v!r} names a tag, not a digest: want registry/repo@sha256:<64 hex>")
            raise ValueError(f"{v!r} is not a reference by digest: want registry/repo@sha256:<64 hex>")
        return v


def _image_kind(v: object) -> str:
    if isinstance(v, dict):
        return "image-published" if "published" in v else "image-recipe"
    return "image-published" if isinstance(v, PublishedImage) else "image-recipe"


#: an image is built from a recipe, or published elsewhere and run as it is
Image = Annotated[Annotated[ImageRecipe, Tag("image-recipe")] | Annotated[PublishedImage, Tag("image-published")],
                  Discriminator(_image_kind)]


class Kit(Strict):
    """A kernel kit: a folder of files, each listed with its sha256 and size in the kit's MANIFEST
    (``sha256 bytes origin two-node path`` lines, ``#`` comments), placed on every host and mounted
    read-only. The files come from ``local`` (a folder, relative to the project or absolute) or from
    ``source`` (a ``[sources]`` entry, at its locked commit) under ``path``; the lock hashes each and
    checks it against the MANIFEST, whose own sha256 is pinned here once known. The folder holds the
    MANIFEST and the files it lists, nothing else but what ``ignore`` (globs, e.g. the kit's own
    ``README.md`` and ``verify_kit.sh``) leaves out. builder.lock.kits locks it."""

    manifest: str = "MANIFEST"
    manifest_sha256: Sha256 | None = None
    local: str | None = None
    source: Name | None = None
    path: str = ""
    ignore: list[str] = []
    expect_files: int | None = Field(default=None, ge=1)
    note: str | None = None

    @field_validator("manifest", "path")
    @classmethod
    def _inside(cls, v: str) -> str:
        if v.startswith("/") or ".." in v.split("/") or "\\" in v:
            raise ValueError("must be a path inside the kit's folder or tree (relative, no '..')")
        return v.strip("/")

    @model_validator(mode="after")
    def _one_origin(self) -> Kit:
        if (self.local is None) == (self.source is None):
            raise ValueError("want exactly one of local (a folder) or source (a [sources] entry)")
        if self.local is not None and self.path:
            raise ValueError("path is the kit's folder in its source's tree: give it with source, not local")
        if not self.manifest:
            raise ValueError("manifest: empty")
        return self


class Pins(Strict):
    format: Literal[1]
    sources: dict[Name, GitSource] = {}
    toolchains: dict[Name, Toolchain] = {}
    bases: dict[Name, BaseImage] = {}
    models: dict[Name, HfModel] = {}
    files: dict[Name, PlainFile] = {}
    kits: dict[Name, Kit] = {}
    wheels: dict[Name, WheelSet] = {}
    images: dict[Name, Image] = {}
    lanes: dict[Name, Lane] = {}

    @model_validator(mode="before")
    @classmethod
    def _one_kind_of_image(cls, data: object) -> object:
        images = data.get("images") if isinstance(data, dict) else None
        for name, img in (images or {}).items() if isinstance(images, dict) else ():
            if isinstance(img, dict) and "published" in img and "recipe" in img:
                raise ValueError(f"images.{name}.published: an image is built from a recipe or published, "
                                 "not both (drop `recipe` or `published`)")
        return data

    @model_validator(mode="after")
    def _references(self) -> Pins:
        for name, img in self.recipes().items():
            self._recipe_references(name, img)
        for name, lane in self.lanes.items():
            self._lane_references(name, lane)
        for name, kit in self.kits.items():
            if kit.source is not None and kit.source not in self.sources:
                raise _Ref(f"kits.{name}.source", kit.source, "sources", self.sources)
        return self

    def _recipe_references(self, name: str, img: ImageRecipe) -> None:
        """Every input a recipe image names is defined, its base first, then each list in order."""
        if img.base is not None and img.base not in self.bases:
            raise _Ref(f"images.{name}.base", img.base, "bases", self.bases)
        for kind in ("sources", "toolchains", "files", "wheels"):
            defined = getattr(self, kind)
            for i, n in enumerate(getattr(img, kind)):
                if n not in defined:
                    raise _Ref(f"images.{name}.{kind}[{i}]", n, kind, defined)

    def _lane_references(self, name: str, lane: Lane) -> None:
        """A lane's image, models and runtime inputs are defined."""
        if lane.image not in self.images:
            raise _Ref(f"lanes.{name}.image", lane.image, "images", self.images)
        for i, m in enumerate(lane.models):
            if m not in self.models:
                raise _Ref(f"lanes.{name}.models[{i}]", m, "models", self.models)
        for n in lane.inputs():
            if n not in self.kits and n not in self.files:
                raise ValueError(f"lanes.{name}: runtime input {n!r} is not defined in [kits] or [files]")

    def recipes(self) -> dict[str, ImageRecipe]:
        """The images built from a recipe."""
        return {n: i for n, i in self.images.items() if isinstance(i, ImageRecipe)}

    def published(self) -> dict[str, PublishedImage]:
        """The images run as published, by digest."""
        return {n: i for n, i in self.images.items() if isinstance(i, PublishedImage)}

    # ---- closure helpers -------------------------------------------------------------

    def kind_of(self, name: str) -> str | None:
        for kind in ("lanes", "images", *INPUT_KINDS):
            if name in getattr(self, kind):
                return kind
        return None

    def closure(self, names: list[str]) -> dict[str, set[str]]:
        """The inputs (by kind) that the named lanes, images or inputs need."""
        out: dict[str, set[str]] = {k: set() for k in INPUT_KINDS}
        for n in names:
            kind = self.kind_of(n)
            if kind is None:
                names = [m for k in ("lanes", "images", *INPUT_KINDS) for m in getattr(self, k)]
                raise ConfigError(f"no lane, image or input named {n!r} in pins{did_you_mean(n, names)}")
            if kind == "lanes":
                lane = self.lanes[n]
                out["models"].update(lane.models)
                for i in lane.inputs():
                    out["kits" if i in self.kits else "files"].add(i)
                self._image_closure(lane.image, out)
            elif kind == "images":
                self._image_closure(n, out)
            else:
                out[kind].add(n)
        for k in out["kits"]:  # a kit from a git source needs that source locked first
            src = self.kits[k].source
            if src is not None:
                out["sources"].add(src)
        return out

    def _image_closure(self, name: str, out: dict[str, set[str]]) -> None:
        img = self.images[name]
        if isinstance(img, PublishedImage):
            return  # its one input is itself (lock.images)
        if img.base:
            out["bases"].add(img.base)
        out["sources"].update(img.sources)
        out["toolchains"].update(img.toolchains)
        out["files"].update(img.files)
        out["wheels"].update(img.wheels)

    def all_inputs(self) -> dict[str, set[str]]:
        return {k: set(getattr(self, k)) for k in INPUT_KINDS}


class _Ref(ValueError):
    def __init__(self, where: str, name: str, kind: str, defined: Iterable[str]) -> None:
        super().__init__(f"{where}: {name!r} is not defined in [{kind}]{did_you_mean(name, defined)}")


def _merge(base: Any, own: Any) -> Any:
    if isinstance(base, dict) and isinstance(own, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in own.items()}}
    return own


def expand_lanes(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """Each lane with ``based_on = "X"`` becomes lane X's table with its own keys merged over it: a table
    key by key, anything else (a list, a string) replaced. Variants of one recipe (vLLM's 128k, 300k and
    1m lanes) then state only what differs."""
    lanes = raw.get("lanes")
    if not isinstance(lanes, dict):
        return raw
    done: dict[str, Any] = {}

    def resolve(name: str, chain: tuple[str, ...]) -> Any:
        if name in done:
            return done[name]
        own = lanes[name]
        base = own.get("based_on") if isinstance(own, dict) else None
        if base is None:
            done[name] = own
            return own
        if not isinstance(base, str) or base not in lanes:
            hint = did_you_mean(base, lanes) if isinstance(base, str) else ""
            raise ConfigError(f"{path}: lanes.{name}.based_on: no lane named {base!r}{hint}")
        if base in chain:
            raise ConfigError(f"{path}: lanes.{name}.based_on: a cycle ({' -> '.join((*chain, name, base))})")
        if not isinstance(lanes[base], dict):
            raise ConfigError(f"{path}: lanes.{base}: expected a table, found {type(lanes[base]).__name__}")
        merged = _merge({k: v for k, v in resolve(base, (*chain, name)).items() if k != "based_on"}, own)
        done[name] = merged
        return merged

    return {**raw, "lanes": {n: resolve(n, ()) for n in lanes}}


PINS_FILE = "pins.toml"


def default_pins(start: Path | None = None) -> Path:
    """The pins file when none is named: `pins.toml` in the working folder (``start``), else in the
    nearest folder above it that has one (as git finds its repository), else `pins.toml` (whose absence
    the command that reads it reports). Its folder is the project root."""
    here = Path.cwd() if start is None else start
    if (here / PINS_FILE).is_file():
        return Path(PINS_FILE) if start is None else here / PINS_FILE
    for folder in here.resolve().parents:
        if (folder / PINS_FILE).is_file():
            return folder / PINS_FILE
    return Path(PINS_FILE)


def default_lock(pins: Path) -> Path:
    """The lock file when none is named: `pins.lock` beside the pins."""
    return pins.parent / "pins.lock"


def default_store(pins: Path) -> Path:
    """The store when none is named: `.cache/builder` under the project root (the pins' folder)."""
    return pins.resolve().parent / ".cache" / "builder"


def load_pins(path: Path) -> Pins:
    """Load and validate pins.toml; every problem is one ConfigError line naming file and key."""
    written = read_toml(path)
    try:
        return validate(Pins, expand_lanes(written, path), path, written)
    except ConfigError as e:
        # cross-reference errors come through pydantic as "(top level): Value error, images.x: ..."
        msg = str(e).replace(": (top level): Value error, ", ": ")
        raise ConfigError(msg) from None


def check_patch_files(pins: Pins, root: Path, pins_path: Path) -> None:
    """Every patch named in the pins must exist in the project."""
    for name, src in sorted(pins.sources.items()):
        for i, p in enumerate(src.patches):
            if not (root / p.file).is_file():
                raise ConfigError(f"{pins_path}: sources.{name}.patches[{i}].file: no such file: {p.file}")
