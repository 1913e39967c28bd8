"""The image config rebuilt canonically: build times replaced by SOURCE_DATE_EPOCH, build-host noise dropped."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from builder.errors import BuilderError
from builder.foundation.canon import canonical_json

#: Keys of the image's run config that are kept; everything else is build-host noise.
KEPT_CONFIG_KEYS = (
    "User",
    "ExposedPorts",
    "Env",
    "Entrypoint",
    "Cmd",
    "Volumes",
    "WorkingDir",
    "Labels",
    "StopSignal",
    "Healthcheck",
    "Shell",
    "OnBuild",
    "ArgsEscaped",
)
#: The classic builder names COPY/ADD sources by a content hash that includes file times.
_SOURCE_HASH = re.compile(r"\b(file|dir|multi):[0-9a-f]{64}\b")


def rfc3339(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def canonical_config(
    original: Mapping[str, Any],
    *,
    diff_ids: Sequence[str],
    source_date_epoch: int,
    base_layers: int = 0,
    labels: Mapping[str, str] | None = None,
) -> bytes:
    """The canonical config bytes for ``original`` with new ``diff_ids`` (see module doc)."""
    when = rfc3339(int(source_date_epoch))
    history = _history(original, base_layers, when)
    non_empty = sum(1 for h in history if not h.get("empty_layer"))
    if non_empty > len(diff_ids):
        raise BuilderError(f"image config: history names {non_empty} layers but there are {len(diff_ids)}")
    for _ in range(len(diff_ids) - non_empty):
        history.append({"created": when, "created_by": "builder: layer"})

    out: dict[str, Any] = {
        "architecture": original.get("architecture", "amd64"),
        "os": original.get("os", "linux"),
        "config": _run_config(original, labels),
        "created": when,
        "history": history,
        "rootfs": {"type": "layers", "diff_ids": list(diff_ids)},
    }
    for key in ("variant", "os.version", "os.features"):
        if original.get(key):
            out[key] = original[key]
    return canonical_json(out)


def _run_config(original: Mapping[str, Any], labels: Mapping[str, str] | None) -> dict[str, Any]:
    """The run config's kept keys that have a value, its labels merged with ``labels``."""
    run_cfg = dict(original.get("config") or {})
    cfg: dict[str, Any] = {}
    for key in KEPT_CONFIG_KEYS:
        value = run_cfg.get(key)
        if value is None or value == "" or value == {}:
            continue
        cfg[key] = value
    merged = {**(run_cfg.get("Labels") or {}), **dict(labels or {})}
    if merged:
        cfg["Labels"] = {str(k): str(v) for k, v in merged.items()}
    return cfg


def _history(original: Mapping[str, Any], base_layers: int, when: str) -> list[dict[str, Any]]:
    """The base's history as it came (through its ``base_layers`` layers), then each later step dated
    ``when``, its COPY/ADD source hashes dropped."""
    history: list[dict[str, Any]] = []
    consumed = 0
    for h in original.get("history") or []:
        if consumed < base_layers:
            history.append(dict(h))  # the base's own history, as it came
            if not h.get("empty_layer"):
                consumed += 1
            continue
        entry: dict[str, Any] = {"created": when}
        created_by = str(h.get("created_by", ""))
        if created_by:
            entry["created_by"] = _SOURCE_HASH.sub(r"\1:-", created_by)
        if h.get("comment"):
            entry["comment"] = str(h["comment"])
        if h.get("empty_layer"):
            entry["empty_layer"] = True
        history.append(entry)
    return history
