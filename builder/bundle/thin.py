"""Thin bundles (``builder bundle --thin --have FILE``): which of an image's layers a host holds
already, so that the bundle's image archive leaves them out."""

from __future__ import annotations

import json
import re
from pathlib import Path

from builder.errors import ConfigError


def read_have(path: Path) -> list[str]:
    """The DiffIDs a host holds, from FILE: an apply record (``state/applied.json``), the installer's
    ``status`` JSON (its ``applied``), or a JSON list of ``sha256:`` digests. ConfigError naming the file."""
    try:
        doc = json.loads(path.read_bytes())
    except OSError as e:
        raise ConfigError(f"--have {path}: cannot read: {e.strerror or e}") from None
    except ValueError:
        raise ConfigError(f"--have {path}: not JSON") from None
    if isinstance(doc, dict) and isinstance(doc.get("applied"), dict):
        doc = doc["applied"]
    if isinstance(doc, dict):
        doc = (doc.get("image") or {}).get("diff_ids") if isinstance(doc.get("image"), dict) else None
    if not isinstance(doc, list) or not all(isinstance(d, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", d)
                                            for d in doc):
        raise ConfigError(f"--have {path}: no layer list (want an apply record, `installer status` JSON "
                          "or a list of sha256: DiffIDs)")
    return list(doc)


def thin_omitted(diff_ids: list[str], have: list[str]) -> int:
    """How many leading layers of the image a thin archive leaves out: the longest prefix the host holds
    (a layer is only of use to `docker load` with every layer below it)."""
    held = set(have)
    n = 0
    while n < len(diff_ids) and diff_ids[n] in held:
        n += 1
    return n
