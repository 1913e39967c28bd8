"""The one loader: read TOML or JSON into a pydantic model, or fail with one line naming file and key."""

from __future__ import annotations

import difflib
import functools
import json
import tomllib
import types
import typing
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

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


def _real_loc(loc: tuple[Any, ...], obj: Any, tags: Collection[str]) -> tuple[Any, ...]:
    """Drop the parts pydantic adds to a location (``tags``: union_tags; validator names) that are not keys
    in the input."""
    out = []
    cur = obj
    for part in loc:
        if isinstance(cur, dict):
            if part in cur:
                out.append(part)
                cur = cur[part]
            elif isinstance(part, str) and not part.startswith("function-") and part not in tags:
                out.append(part)  # a missing key: keep it, stop walking
                cur = None
        elif isinstance(cur, list) and isinstance(part, int):
            out.append(part)
            cur = cur[part] if 0 <= part < len(cur) else None
        elif cur is None and isinstance(part, str | int) and not (isinstance(part, str) and part in tags):
            out.append(part)
    return tuple(out)


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _literal_tags(tp: Any) -> set[str]:
    """The values of a union member's ``Literal`` fields (its discriminator, e.g. ``kind = "zig"``) and its
    class name: the names pydantic puts in an error's location for the member the input chose."""
    inner = _strip(tp)
    out: set[str] = set()
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        out.add(inner.__name__)
        for f in inner.model_fields.values():
            if typing.get_origin(_strip(f.annotation)) is typing.Literal:
                out |= {str(v) for v in typing.get_args(_strip(f.annotation))}
    return out


def _tag(tp: Any) -> set[str]:
    """A union member's ``Tag`` (a callable discriminator's name for it)."""
    if typing.get_origin(tp) is not typing.Annotated:
        return set()
    return {str(m.tag) for m in typing.get_args(tp)[1:] if hasattr(m, "tag")}


def _discriminator(tp: Any, meta: Iterable[Any] = ()) -> str | None:
    """The field that picks a union's member (``Field(discriminator="kind")``, on the union or on the field
    that holds it), or None."""
    found = [*(typing.get_args(tp)[1:] if typing.get_origin(tp) is typing.Annotated else ()), *meta]
    for m in found:
        d = getattr(m, "discriminator", None)
        d = getattr(d, "discriminator", d)  # (a Discriminator object holds the field's name, or a callable)
        if isinstance(d, str):
            return d
    return None


def _member_tags(member: Any, discriminator: str | None) -> set[str]:
    """What pydantic names a union member in an error's location: its ``Tag`` (a callable discriminator),
    the value of its discriminator field (``kind = "zig"``), else its validator's name (``int``,
    ``literal['auto']``, a model's class name)."""
    tags = _tag(member)
    if tags:
        return tags
    inner = _strip(member)
    if discriminator is not None and isinstance(inner, type) and issubclass(inner, BaseModel):
        f = inner.model_fields.get(discriminator)
        if f is not None and typing.get_origin(_strip(f.annotation)) is typing.Literal:
            return {str(v) for v in typing.get_args(_strip(f.annotation))}
    return {TypeAdapter(member).validator.title}


@functools.cache
def union_tags(model: type[BaseModel]) -> frozenset[str]:
    """Every name pydantic puts in an error's location for a union member anywhere in ``model``'s schema:
    read from the schema, so that a new kind of input is known here the moment it is declared. None of
    them is a key of the input."""
    out: set[str] = set()
    seen: set[type[BaseModel]] = set()

    def walk(tp: Any, meta: Iterable[Any] = ()) -> None:
        discriminator = _discriminator(tp, meta)
        inner = _strip(tp)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            if inner not in seen:
                seen.add(inner)
                for f in inner.model_fields.values():
                    walk(f.annotation, (f,))
            return
        args = typing.get_args(inner)
        members = [m for m in args if m is not type(None)]
        # (`X | None` is no union to pydantic: it names no member)
        if typing.get_origin(inner) in (typing.Union, types.UnionType) and len(members) > 1:
            for m in members:
                out.update(_member_tags(m, discriminator))
        for a in args:
            walk(a)

    walk(model)
    return frozenset(out)


def _step(tps: list[Any], part: Any) -> list[Any]:
    """The types found one location part further down from each of ``tps`` (a union gives several)."""
    out: list[Any] = []
    for tp in tps:
        out += _step_into(_strip(tp), part)
    return out


def _step_into(inner: Any, part: Any) -> list[Any]:
    """The types found one location part further down from one type (its ``Annotated`` stripped)."""
    origin = typing.get_origin(inner)
    if origin in (typing.Union, types.UnionType):
        return _step_union(inner, part)
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return [f.annotation for name, f in inner.model_fields.items() if part in (name, f.alias)]
    if origin is dict and len(typing.get_args(inner)) == 2:
        return [typing.get_args(inner)[1]]
    if origin in (list, set, frozenset, tuple) and isinstance(part, int) and typing.get_args(inner):
        return [typing.get_args(inner)[0]]
    return []


def _step_union(inner: Any, part: Any) -> list[Any]:
    """A union's members that ``part`` names (by its tag), or the types one part down from its members."""
    members = [m for m in typing.get_args(inner) if m is not type(None)]
    if isinstance(part, str) and any(part in _tag(m) for m in members):
        # a callable discriminator guessed the member from the keys present, a misspelt one
        # among them: every member's keys are candidates
        return members
    chosen = [m for m in members if isinstance(part, str) and part in _literal_tags(m)]
    return chosen if chosen else _step(members, part)


def known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> set[str]:
    """The keys the schema knows at ``loc`` (pydantic's location of a table: keys, indexes and the tags it
    adds); empty where it is not a table of known keys."""
    tps: list[Any] = [model]
    for part in loc:
        if isinstance(part, str) and part.startswith("function-"):
            continue
        nxt = _step(tps, part)
        if not nxt and isinstance(part, str):
            continue  # a tag this walk does not know: stay where it is
        tps = nxt
    keys: set[str] = set()
    for tp in tps:
        inner = _strip(tp)
        members = typing.get_args(inner) if typing.get_origin(inner) in (typing.Union, types.UnionType) else (inner,)
        for m in members:
            m = _strip(m)
            if isinstance(m, type) and issubclass(m, BaseModel):
                keys |= {f.alias or name for name, f in m.model_fields.items()}
    return keys


def did_you_mean(name: object, candidates: Iterable[str], prefer: Collection[str] = ()) -> str:
    """`` (did you mean `X`?)`` with the closest of ``candidates`` to a name or key the operator typed, or "":
    the one form every unknown name (a lane, a host, a model, a fleet) and unknown key takes. Closest is
    difflib's ratio, at least 0.6, of ``name`` as typed or as a key is spelt (lower case, ``_`` for ``-``);
    between equally close candidates, one in ``prefer`` (a key reported missing beside an unknown one),
    then the first by name."""
    if not isinstance(name, str):
        return ""
    best: tuple[float, bool, str] | None = None
    for spelling in dict.fromkeys([name, name.lower().replace("-", "_")]):
        for c in sorted(set(candidates)):
            m = difflib.SequenceMatcher(None, spelling, c)
            if m.real_quick_ratio() < 0.6 or m.quick_ratio() < 0.6:
                continue
            score = m.ratio()
            # (rank: the score, then a preferred candidate; the first by name wins a tie, as sorted)
            if score >= 0.6 and (best is None or (score, c in prefer) > best[:2]):
                best = (score, c in prefer, c)
    return f" (did you mean `{best[2]}`?)" if best else ""


def validation_message(path: Path | str, err: ValidationError, obj: Any = None,
                       model: type[BaseModel] | None = None, written: Any = None) -> str:
    """First error as 'FILE: KEY: what is wrong' (plus a count of the others). An unknown key comes before
    any other error (a misspelt key is also a "missing" one) and is named with the closest key the schema
    knows there (``model``), or that another error says is missing beside it; a key the file wrote there
    (``written``, where ``obj`` was made from it: a lane ``based_on`` another) is no suggestion."""
    errors = err.errors(include_url=False)
    tags = union_tags(model) if model is not None else frozenset()
    e = _first_error(errors, model, tags)
    if e["type"] == "union_tag_not_found" and model is not None:
        e = _stray_key_error(e, obj, model, tags)
    raw_loc = tuple(e["loc"])
    loc = _real_loc(raw_loc, obj, tags) if obj is not None else tuple(
        x for x in raw_loc if not (isinstance(x, str) and x.startswith("function-")))
    # pydantic puts the tag of a discriminated union in the path; drop it for readability
    msg = e["msg"]
    if e["type"] == "extra_forbidden":
        msg = _unknown_key_message(errors, raw_loc, loc, obj if written is None else written, model)
    elif e["type"] == "missing":
        msg = "missing required key"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{path}: {key_path(loc)}: {msg}{more}"


def _first_error(errors: list[Any], model: type[BaseModel] | None, tags: Collection[str]) -> Any:
    """The error to name: an unknown key before any other error (a misspelt key is also a "missing" one)."""
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    if model is not None and len(unknown) > 1:
        # a union without a discriminator is tried member by member, and each member calls the others' keys
        # unknown: a key that no member of the union (the table without the member's tag) knows comes first
        def known_to_one(x: Any) -> bool:
            table = tuple(x["loc"])[:-1]
            if table and table[-1] in tags:
                table = table[:-1]
            return x["loc"][-1] in known_keys(model, table)

        unknown.sort(key=known_to_one)
    return unknown[0] if unknown else errors[0]


def _stray_key_error(e: Any, obj: Any, model: type[BaseModel], tags: Collection[str]) -> Any:
    """A table whose discriminator (`kind`) is misspelt: pydantic names no key; the one no member of the
    union knows is the one to name (as an unknown key), when there is one."""
    raw_loc = tuple(e["loc"])
    here = _at(obj, _real_loc(raw_loc, obj, tags)) if obj is not None else None
    known = known_keys(model, raw_loc)
    strays = sorted(k for k in here if isinstance(k, str) and k not in known) if isinstance(here, dict) else []
    if known and strays:
        return {**e, "type": "extra_forbidden", "loc": (*raw_loc, strays[0])}
    return e


def _unknown_key_message(errors: list[Any], raw_loc: tuple[Any, ...], loc: tuple[Any, ...], written: Any,
                         model: type[BaseModel] | None) -> str:
    """The message for an unknown key: it names the closest key the schema knows there, or that another
    error says is missing beside it; none that ``written`` already has there."""
    parent = raw_loc[:-1]
    missing = {str(x["loc"][-1]) for x in errors
               if x["type"] == "missing" and x["loc"] and tuple(x["loc"])[:-1] == parent}
    candidates = (known_keys(model, parent) if model is not None else set()) | missing
    present = _at(written, loc[:-1])
    if isinstance(present, dict):
        candidates -= {k for k in present if isinstance(k, str)}  # a key already there is no suggestion
    return "unknown key" + did_you_mean(loc[-1] if loc else None, candidates, prefer=missing)


def _at(obj: Any, loc: tuple[Any, ...]) -> Any:
    for part in loc:
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, list) and isinstance(part, int) and 0 <= part < len(obj):
            obj = obj[part]
        else:
            return None
    return obj


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


def validate(model: type[M], obj: Any, source: Path | str, written: Any = None) -> M:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise ConfigError(validation_message(source, e, obj, model, written)) from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply") from None


def load_json(model: type[M], path: Path) -> M:
    return validate(model, read_json(path), path)
