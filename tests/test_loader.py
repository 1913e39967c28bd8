"""The loader's error locations and suggestions. The documents here are made from the schemas
themselves: every table any file's schema declares (each kind of input of each union among them) gets
an unknown key, and the error must name that key where the document wrote it, with no name pydantic
adds (a union member's tag) in between."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from builder.errors import ConfigError
from builder.image.imagerecord import ImageRecord
from builder.inputs.hosts import Fleet
from builder.inputs.loader import did_you_mean, key_path, validate
from builder.inputs.pins import Pins
from builder.lock.lockfile import Lock

#: the files builder reads through the loader, each by its schema
SCHEMAS: list[type[BaseModel]] = [Pins, Lock, Fleet, ImageRecord]
BAD = "no_such_key"

Wrap = Callable[[Any], Any]


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _stub(model: type[BaseModel]) -> dict[str, Any]:
    """A table of `model` with every required key and every fixed-value key (a discriminator such as
    ``kind``: its first value), so that a union picks this model by its tag or by the keys present;
    the values are not valid, but an unknown key is reported before any other error."""
    out: dict[str, Any] = {}
    for name, f in model.model_fields.items():
        tp = _strip(f.annotation)
        if typing.get_origin(tp) is typing.Literal:
            out[f.alias or name] = typing.get_args(tp)[0]
        elif f.is_required():
            out[f.alias or name] = "x"
    return out


def _tables(tp: Any, wrap: Wrap, loc: tuple[Any, ...], seen: set[type[BaseModel]]) -> Iterator[tuple[str, Any, str]]:
    """(what, document, expected key) for every table reachable from `tp`, placed by `wrap` at `loc`."""
    inner = _strip(tp)
    origin = typing.get_origin(inner)
    args = typing.get_args(inner)
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        stub = _stub(inner)
        yield f"{inner.__name__} at {key_path(loc)}", wrap({**stub, BAD: 1}), key_path((*loc, BAD))
        if inner in seen:
            return
        seen = seen | {inner}
        for name, f in inner.model_fields.items():
            key = f.alias or name

            def at(v: Any, key: str = key, stub: dict[str, Any] = stub) -> Any:
                return wrap({**stub, key: v})

            yield from _tables(f.annotation, at, (*loc, key), seen)
    elif origin in (typing.Union, types.UnionType):
        for m in args:
            yield from _tables(m, wrap, loc, seen)
    elif origin is dict:
        yield from _tables(args[1], lambda v: wrap({"k": v}), (*loc, "k"), seen)
    elif origin in (list, set, frozenset, tuple) and args:
        yield from _tables(args[0], lambda v: wrap([v]), (*loc, 0), seen)


def _cases() -> Iterator[Any]:
    for schema in SCHEMAS:
        for what, doc, key in _tables(schema, lambda v: v, (), set()):
            yield pytest.param(schema, doc, key, id=f"{schema.__name__}: {what}")


@pytest.mark.parametrize(("schema", "doc", "key"), list(_cases()))
def test_an_unknown_key_is_named_where_the_file_wrote_it(schema: type[BaseModel], doc: Any, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate(schema, doc, "f")
    assert str(e.value).startswith(f"f: {key}: unknown key"), str(e.value)


def test_did_you_mean_takes_the_closest_and_prefers_what_is_missing() -> None:
    assert did_you_mean("dmeo", ["demo", "other"]) == " (did you mean `demo`?)"
    assert did_you_mean("zzzz", ["demo"]) == ""
    assert did_you_mean("Tensor-Parallel", ["tensor_parallel", "streams"]) == " (did you mean `tensor_parallel`?)"
    # equally close: the one reported missing, else the first by name
    assert did_you_mean("abc", ["abd", "abe"]) == " (did you mean `abd`?)"
    assert did_you_mean("abc", ["abd", "abe"], prefer={"abe"}) == " (did you mean `abe`?)"
    assert did_you_mean(3, ["demo"]) == ""
