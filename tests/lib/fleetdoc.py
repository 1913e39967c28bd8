"""docs/fleet-file.md, the fleet file's reference, generated from its schema (builder/inputs/hosts.py).

    python3 -m tests.lib.fleetdoc           # print the page
    python3 -m tests.lib.fleetdoc --write   # write docs/fleet-file.md
    python3 -m tests.lib.fleetdoc --check   # exit 1 when docs/fleet-file.md is not what the schema gives

Every key of every table, its type, whether it is required, its default, its constraints, its description
and its example come from the pydantic models (`Field(description=..., examples=[...])`); the page's
example fleet file is validated by the same schema before it is written. tests/test_fleetdoc.py checks
that the page in the tree is the one the schema gives.
"""

from __future__ import annotations

import json
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from builder.foundation.canon import atomic_write
from builder.inputs import hosts

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "fleet-file.md"

#: (the table as a fleet file spells it, its model)
TABLES: list[tuple[str, type[BaseModel]]] = [
    ("[fleet]", hosts.FleetInfo),
    ("[[hosts]]", hosts.Host),
    ("[hosts.fabric]", hosts.Fabric),
    ("[hosts.paths]", hosts.Paths),
    ("[hosts.expect]", hosts.Expect),
    ("[hosts.expect.burn]", hosts.Burn),
]

#: the page's example: two hosts with what a fleet file most often says (validated before it is written)
EXAMPLE = """\
[fleet]
name = "pair"
lane = "tensorfold-tp2"
trusted_key = "../keys/builder.pub"   # what `builder keygen --out keys` writes

[[hosts]]
name = "spark-1"
ssh = "operator@192.0.2.10"
rank = 0
role = "head"
address = "192.0.2.110"
fabric = { rails = ["192.0.2.110"], interfaces = ["enp1s0f0np0"], rdma_devices = ["rocep1s0f0"], gid_index = 3 }
expect = { gpu_name = "NVIDIA GB10", compute_cap = "12.1", min_free_memory_gib = 112, min_free_disk_gib = 30 }

[[hosts]]
name = "spark-2"
ssh = "operator@192.0.2.11"
rank = 1
role = "worker"
address = "192.0.2.111"
fabric = { rails = ["192.0.2.111"], interfaces = ["enp1s0f0np0"], rdma_devices = ["rocep1s0f0"], gid_index = 3 }
expect = { gpu_name = "NVIDIA GB10", compute_cap = "12.1", min_free_memory_gib = 112, min_free_disk_gib = 30 }
"""


def type_name(t: Any) -> str:
    """A field's type as the TOML author writes it."""
    origin = typing.get_origin(t)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(t))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return " \\| ".join(type_name(a) for a in args)
    if origin is list:
        (arg,) = typing.get_args(t)
        return f"list of {type_name(arg)}"
    if origin is typing.Annotated:
        return type_name(typing.get_args(t)[0])
    if isinstance(t, type) and issubclass(t, BaseModel):
        return "table"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(t, str(t))


def constraints(f: FieldInfo) -> list[str]:
    out = []
    for m in f.metadata:
        if isinstance(m, annotated_types.Ge):
            out.append(f"≥ {m.ge}")
        elif isinstance(m, annotated_types.Gt):
            out.append(f"> {m.gt}")
        elif isinstance(m, annotated_types.Le):
            out.append(f"≤ {m.le}")
        elif isinstance(m, annotated_types.MinLen):
            out.append(f"at least {m.min_length} {'item' if f.annotation is not str else 'character'}"
                       f"{'s' if m.min_length != 1 else ''}")
        elif getattr(m, "pattern", None):
            out.append(f"matches `{m.pattern}`")
    return out


def toml_value(v: Any) -> str:
    """A value as TOML writes it (inline)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {v!r}")


def default(f: FieldInfo) -> str:
    if f.is_required():
        return "required"
    d = f.get_default(call_default_factory=True)
    if d is None:
        return "unset"
    if isinstance(d, BaseModel):
        return "its keys' defaults"
    return f"`{toml_value(d)}`"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(title: str, model: type[BaseModel]) -> list[str]:
    doc = " ".join((model.__doc__ or "").split("\n\n")[0].split())
    lines = [f"## `{title}`", ""]
    if doc:
        lines += [doc, ""]
    lines += ["| key | type | default | what | example |", "|---|---|---|---|---|"]
    for name, f in model.model_fields.items():
        what = f.description or ""
        if not what:
            raise ValueError(f"{model.__name__}.{name}: no description (give it Field(description=...))")
        rule = constraints(f)
        if rule:
            what += f" ({', '.join(rule)})"
        example = "; ".join(f"`{toml_value(e)}`" for e in (f.examples or []))
        lines.append(f"| `{name}` | {type_name(f.annotation)} | {default(f)} | {cell(what)} | {cell(example)} |")
    return [*lines, ""]


def render() -> str:
    hosts.Fleet.model_validate(tomllib.loads(EXAMPLE))  # the example is a valid fleet file
    lines = [
        "# The fleet file",
        "",
        "<!-- generated from builder/inputs/hosts.py by `python3 -m tests.lib.fleetdoc --write`; edit the "
        "schema, not this page (tests/test_fleetdoc.py compares them) -->",
        "",
        "A fleet file, `hosts/NAME.toml`, names the hosts of one fleet, the lane they run, and what the audit "
        "expects of each host. builder reads every `*.toml` of `hosts/` and checks each against this schema "
        "before it contacts any host: an unknown key, a value of the wrong type or outside its range is "
        "refused in one line naming the file and the key (exit 2).",
        "",
        "Beyond each key's own rule:",
        "",
        "* the ranks of a fleet are 0 to N-1, each once; rank 0 is the `head` and only rank 0;",
        "* host names are unique in the fleet, and fleet names among the fleet files of `hosts/`;",
        "* `fleet.lane` is a lane of `pins.toml` (and of `pins.lock` where a command needs the lock);",
        "* a relative path (`fleet.trusted_key`, `fleet.ssh_config`, `fleet.registry_ca`) is taken from the "
        "fleet file's folder, wherever builder runs (`builder/inputs/hosts.py` `fleet_relative`);",
        "* `hosts.ssh` is `[user@]host[:port]`, `[user@][v6addr]:port` or an ssh_config alias, never starting "
        "with `-` and without whitespace; `fabric.rails` are IPv4 addresses; `paths` are absolute, "
        "without `..`; `fleet.registry` starts with `https://` or `http://`.",
        "",
        "A host table may be written as tables (`[hosts.expect]` after its `[[hosts]]`) or inline "
        "(`expect = { … }`), as TOML allows.",
        "",
    ]
    for title, model in TABLES:
        lines += table(title, model)
    lines += [
        "## An example",
        "",
        "```toml",
        *EXAMPLE.rstrip("\n").split("\n"),
        "```",
        "",
        "Whole fleets: [hosts/spark-tp4.toml](../hosts/spark-tp4.toml) (four Sparks, one rail each, the "
        "burn gate), [hosts/spark-tp2.toml](../hosts/spark-tp2.toml) (two Sparks, two rails each), "
        "[hosts/h200-local.toml](../hosts/h200-local.toml) (one machine audited through `connection = "
        "\"local\"`). `python3 -m tests.fleet.local up` writes `hosts/local.toml`, a fleet of local test "
        "hosts (README: the quick tour).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--write" in argv:
        atomic_write(PAGE, text.encode())
        print(PAGE)
    elif "--check" in argv:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE}: not what the schema gives; run `python3 -m tests.lib.fleetdoc --write`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
