"""What ``builder image`` lays out as an image's build context, said from the pins and the recipe folder alone
(no lock, no store, no network): the oracle the recipe checks read (tests/test_recipes.py), itself checked
there against a real ``assemble_context``."""

from __future__ import annotations

from pathlib import Path

from builder.errors import ConfigError
from builder.foundation.hashing import recipe_files
from builder.image import wheels
from builder.image.build import CLOSURE_FILE, source_dir, toolchain_dir
from builder.inputs.pins import ImageRecipe, Pins


def context_layout(pins: Pins, name: str, root: Path) -> dict[str, str]:
    """Path (relative, ``/``) to kind: ``file``; ``tree`` (a source tree, the locked commit's content, which
    only the lock can name); ``dir`` (a folder assembly fills: a toolchain, ``files/``). The recipe
    folder's own files are listed as files (and their folders as ``dir``)."""
    img = pins.images[name]
    if not isinstance(img, ImageRecipe):
        raise ConfigError(f"images.{name}: a published image has no recipe; nothing is built")
    out: dict[str, str] = {}
    for rel in recipe_files(root, img.recipe):
        parts = Path(rel).relative_to(img.recipe).parts
        for k in range(1, len(parts)):
            out.setdefault("/".join(parts[:k]), "dir")
        out["/".join(parts)] = "file"
    for i, sname in enumerate(img.sources):
        out[source_dir(i, sname)] = "tree"
    for tname in img.toolchains:
        where = toolchain_dir(pins.toolchains[tname].kind, tname)
        if where is not None:
            out.setdefault(where.split("/", 1)[0], "dir")
            out[where] = "dir"
    if img.files:
        out["files"] = "dir"
        for fname in img.files:
            out[f"files/{fname}"] = "file"
    if img.wheels:
        out[wheels.CONTEXT_DIR] = "dir"
    out[CLOSURE_FILE] = "file"
    return out
