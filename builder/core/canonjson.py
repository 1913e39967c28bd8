"""Canonical JSON: the bytes that a manifest, a content address and a signature are computed over."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, fixed separators, UTF-8: the same object gives the same bytes on any machine."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
