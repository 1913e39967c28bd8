"""The one loader: read TOML or JSON into a pydantic model, or fail with one line naming file and key."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from builder.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def key_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            s = str(part)
            out += ("." if out else "") + (s if s.replace("_", "").replace("-", "").isalnum() else json.dumps(s))
    return out or "(top level)"


def _real_loc(loc: tuple[Any, ...], obj: Any) -> tuple[Any, ...]:
    """Drop the parts pydantic adds to a location (union tags, validator names) that are not keys in the input."""
    out = []
    cur = obj
    for part in loc:
        if isinstance(cur, dict):
            if part in cur:
                out.append(part)
                cur = cur[part]
            elif isinstance(part, str) and not part.startswith("function-") and part not in _TAGS:
                out.append(part)  # a missing key: keep it, stop walking
                cur = None
        elif isinstance(cur, list) and isinstance(part, int):
            out.append(part)
            cur = cur[part] if 0 <= part < len(cur) else None
        elif cur is None and isinstance(part, str | int) and not (isinstance(part, str) and part in _TAGS):
            out.append(part)
    return tuple(out)


# tags pydantic inserts into locations for discriminated unions and similar
_TAGS = {"zig", "cuda", "wheel", "int", "str", "literal['auto']", "image-recipe", "image-published"}


def validation_message(path: Path | str, err: ValidationError, obj: Any = None) -> str:
    """First error as 'FILE: KEY: what is wrong' (plus a count of the others)."""
    errors = err.errors(include_url=False)
    e = errors[0]
    loc = _real_loc(tuple(e["loc"]), obj) if obj is not None else tuple(
        x for x in e["loc"] if not (isinstance(x, str) and x.startswith("function-")))
    # pydantic puts the tag of a discriminated union in the path; drop it for readability
    msg = e["msg"]
    if e["type"] == "extra_forbidden":
        msg = "unknown key"
    elif e["type"] == "missing":
        msg = "missing required key"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{path}: {key_path(loc)}: {msg}{more}"


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None


def read_toml(path: Path) -> dict[str, Any]:
    raw = _read_bytes(path)
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None


def read_json(path: Path) -> Any:
    raw = _read_bytes(path)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"{path}: malformed JSON: {e}") from None


def validate(model: type[M], obj: Any, source: Path | str) -> M:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise ConfigError(validation_message(source, e, obj)) from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply") from None


def load_toml(model: type[M], path: Path) -> M:
    return validate(model, read_toml(path), path)


def load_json(model: type[M], path: Path) -> M:
    return validate(model, read_json(path), path)
