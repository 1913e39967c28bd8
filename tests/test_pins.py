"""The pins.toml schema: valid pins load; every bad one is one ConfigError line naming file and key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from builder.errors import ConfigError
from builder.inputs.pins import check_patch_files, load_pins

GOOD = """format = 1

[sources.engine]
url = "engine-src/demo-engine.bundle"
ref = "main"
rev = "5940208"
patches = [{ file = "patches/0001-x.patch", reason = "why" }]

[toolchains.zig]
kind = "zig"
version = "0.13.0"
[toolchains.zig.platforms."linux/arm64"]
url = "https://ziglang.org/download/0.13.0/zig-linux-aarch64-0.13.0.tar.xz"
sha256 = "ZIGSHA"

[toolchains.cuda]
kind = "cuda"
version = "13.0"

[bases.ngc]
ref = "nvcr.io/nvidia/pytorch:26.07-py3"
platforms = ["linux/arm64"]

[models.engram]
repo = "org/base"
revision = "main"
include = ["model-00047-of-*.safetensors", "model-00048-of-*.safetensors"]
expect_files = 2

[files.template]
url = "files/chat.jinja"
sha256 = "FILESHA"

[images.demo]
recipe = "images/demo"
base = "ngc"
sources = ["engine"]
toolchains = ["zig", "cuda"]
files = ["template"]

[lanes.demo]
image = "demo"
models = ["engram"]
[lanes.demo.serve]
tensor_parallel = 2
context = 8192
streams = 4
port = 8000
served_name = "demo"
""".replace("ZIGSHA", "a" * 64).replace("FILESHA", "b" * 64)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pins.toml"
    p.write_text(text)
    return p


def test_good_pins_and_closures(tmp_path: Path) -> None:
    pins = load_pins(write(tmp_path, GOOD))
    assert pins.sources["engine"].rev == "5940208"
    assert pins.toolchains["zig"].kind == "zig"
    c = pins.closure(["demo"])
    assert c == {
        "sources": {"engine"},
        "toolchains": {"zig", "cuda"},
        "bases": {"ngc"},
        "models": {"engram"},
        "files": {"template"},
        "kits": set(),
        "wheels": set(),
    }
    assert pins.closure(["engram"])["models"] == {"engram"} and pins.closure(["engram"])["sources"] == set()
    with pytest.raises(ConfigError, match="no lane, image or input named 'nope'"):
        pins.closure(["nope"])


def test_misspelt_names_get_the_closest(tmp_path: Path) -> None:
    """A lane, image, model or input name one edit away from a defined one is named with it; a name far
    from every one gets no suggestion."""
    pins = load_pins(write(tmp_path, GOOD))
    with pytest.raises(ConfigError, match=r"no lane, image or input named 'dmeo' in pins \(did you mean `demo`\?\)$"):
        pins.closure(["dmeo"])
    with pytest.raises(ConfigError) as e:
        pins.closure(["zzzzzz"])
    assert "did you mean" not in str(e.value)
    for old, new, needle in [
        ('models = ["engram"]', 'models = ["engrm"]',
         "lanes.demo.models[0]: 'engrm' is not defined in [models] (did you mean `engram`?)"),
        ('base = "ngc"', 'base = "ngcc"', "images.demo.base: 'ngcc' is not defined in [bases] (did you mean `ngc`?)"),
    ]:
        assert old in GOOD
        with pytest.raises(ConfigError) as e:
            load_pins(write(tmp_path, GOOD.replace(old, new)))
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_misspelt_names_through_the_cli() -> None:
    """Typos of a lane, an image, a model and a fleet in the shipped project, as an operator types them."""
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUILDER_")}
    for args, needle in [
        (["lock", "--check", "dmeo"], "no lane, image or input named 'dmeo' in pins (did you mean `demo`?)"),
        (["fetch", "--offline", "demo-tinyy"], "(did you mean `demo-tiny`?)"),
        (["image", "dmeo"], "no image named 'dmeo' (did you mean `demo`?)"),
        (["launch", "--fleet", "spark-tp4", "--lane", "tensorfold-tp44"], "(did you mean `tensorfold-tp4`?)"),
        (["launch", "--fleet", "spark-tp44"], "no fleet named 'spark-tp44' (did you mean `spark-tp4`?)"),
    ]:
        r = subprocess.run([sys.executable, "-m", "builder", *args], cwd=repo, env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        (line,) = r.stderr.strip().splitlines()
        assert needle in line, (args, line)


@pytest.mark.parametrize(
    "old,new,needle",
    [
        ('ref = "main"\nrev', 'ref = "main"\nbranch = "x"\nrev', "sources.engine.branch: unknown key"),
        ('kind = "cuda"\nversion = "13.0"', 'kind = "cuda"\nversion = "13.0"\nextra = 1', "toolchains.cuda"),
        ('rev = "5940208"', 'rev = "594"', "sources.engine.rev"),
        ('file = "patches/0001-x.patch"', 'file = "../x.patch"', "sources.engine.patches[0].file"),
        ('base = "ngc"', 'base = "nope"', "images.demo.base: 'nope' is not defined in [bases]"),
        (
            'models = ["engram"]',
            'models = ["gone"]',
            "lanes.demo.models[0]: 'gone' is not defined in [models]",
        ),
        ('recipe = "images/demo"', 'recipe = "elsewhere"', "images.demo.recipe"),
        (
            'platforms = ["linux/arm64"]\n\n[models',
            'platforms = ["linux/riscv"]\n\n[models',
            "bases.ngc.platforms[0]",
        ),
        ("format = 1", "format = 2", "format"),
        ("port = 8000", "port = 80000", "lanes.demo.serve.port"),
    ],
)
def test_bad_pins_are_one_line(tmp_path: Path, old: str, new: str, needle: str) -> None:
    assert old in GOOD
    p = write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(ConfigError) as ei:
        load_pins(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: ") and needle in msg and "\n" not in msg
    assert ei.value.exit_code == 2


def test_malformed_and_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="malformed TOML"):
        load_pins(write(tmp_path, GOOD + "\n[[["))
    with pytest.raises(ConfigError, match="file not found"):
        load_pins(tmp_path / "none.toml")


def test_missing_patch_file_names_the_key(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD)
    pins = load_pins(p)
    with pytest.raises(ConfigError) as ei:
        check_patch_files(pins, tmp_path, p)
    assert str(ei.value) == f"{p}: sources.engine.patches[0].file: no such file: patches/0001-x.patch"
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "0001-x.patch").write_text("x")
    check_patch_files(pins, tmp_path, p)


def test_a_lane_based_on_another_states_only_what_differs() -> None:
    pins = load_pins(Path(__file__).resolve().parents[1] / "pins.toml")
    base, eager = pins.lanes["vllm-native"], pins.lanes["vllm-native-1m"]
    assert eager.based_on == "vllm-native" and eager.serve.context == 1048576
    assert eager.serve.streams == base.serve.streams and eager.mounts == base.mounts  # taken from the base
    assert eager.env["VLLM_CACHE_ROOT"] == "/cache/vllm-1m" and eager.env["MAX_JOBS"] == "2"  # tables merge
    assert eager.roles.head.args is not None and "--enforce-eager" in eager.roles.head.args  # lists replace
    assert base.roles.head.args is not None and "--enforce-eager" not in base.roles.head.args


@pytest.mark.parametrize(("lanes", "needle"), [
    ({"b": {"based_on": "nope"}}, "lanes.b.based_on: no lane named 'nope'"),
    ({"a": {"based_on": "b"}, "b": {"based_on": "a"}}, "based_on: a cycle (a -> b -> a)"),
])
def test_bad_based_on_is_one_line(tmp_path: Path, lanes: dict[str, dict[str, str]], needle: str) -> None:
    text = "format = 1\n" + "".join(f'[lanes.{n}]\nbased_on = "{b["based_on"]}"\n' for n, b in lanes.items())
    (tmp_path / "pins.toml").write_text(text)
    with pytest.raises(ConfigError) as e:
        load_pins(tmp_path / "pins.toml")
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_base_lane_that_is_not_a_table_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "pins.toml").write_text('format = 1\n[lanes]\nx = "str"\n[lanes.y]\nbased_on = "x"\n')
    with pytest.raises(ConfigError) as e:
        load_pins(tmp_path / "pins.toml")
    assert str(e.value) == f"{tmp_path / 'pins.toml'}: lanes.x: expected a table, found str"


def test_a_misspelt_key_of_a_lane_based_on_another_gets_its_suggestion(tmp_path: Path) -> None:
    """The lane inherits `serve` from its base, but the file wrote `serv`: the suggestion is `serve`."""
    shipped = (Path(__file__).resolve().parents[1] / "pins.toml").read_text()
    text = shipped.replace("[lanes.vllm-native-128k.serve]", "[lanes.vllm-native-128k.serv]")
    assert text != shipped
    (tmp_path / "pins.toml").write_text(text)
    with pytest.raises(ConfigError) as e:
        load_pins(tmp_path / "pins.toml")
    assert str(e.value) == (f"{tmp_path / 'pins.toml'}: lanes.vllm-native-128k.serv: unknown key "
                            "(did you mean `serve`?)")


def test_pins_is_found_from_a_subfolder_and_named_pins_win(tmp_path: Path) -> None:
    """From a folder inside a project, builder takes the nearest pins.toml above (its folder is the
    root: hosts/, the lock, the store); BUILDER_PINS and --pins, when given, win over it."""
    from tests.lib import auditlib

    def project(name: str, fleet: str) -> Path:
        root = auditlib.make_project(tmp_path / name)["pins"].parent
        (root / "hosts").mkdir(exist_ok=True)
        (root / "hosts" / f"{fleet}.toml").write_text(auditlib.fleet_toml(fleet, [
            {"name": f"{fleet}-1", "ssh": "spark@192.0.2.1", "rank": 0, "role": "head"},
            {"name": f"{fleet}-2", "ssh": "spark@192.0.2.2", "rank": 1, "role": "worker"}]))
        return root

    root, other = project("proj", "here"), project("other", "there")
    deep = root / "images" / "demo" / "sub"
    deep.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUILDER_")}

    def hosts(*args: str, **extra: str) -> list[str]:
        r = subprocess.run([sys.executable, "-m", "builder", *args, "hosts", "--json"], cwd=deep,
                           env={**env, **extra}, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return [h["file"] for h in json.loads(r.stdout)]

    assert hosts() == [str(root / "hosts" / "here.toml")] * 2
    assert hosts(BUILDER_PINS=str(other / "pins.toml")) == [str(other / "hosts" / "there.toml")] * 2
    assert hosts("--pins", str(other / "pins.toml")) == [str(other / "hosts" / "there.toml")] * 2
    r = subprocess.run([sys.executable, "-m", "builder", "lock", "--check"], cwd=deep, env=env,
                       capture_output=True, text=True, timeout=120)
    # (the lock beside the pins found above: this hand-made one is stale, and named by its full path)
    assert r.returncode == 1 and r.stderr.startswith(f"error: {root / 'pins.lock'}: stale: "), r.stderr
    # outside any project: the pins file is named as missing, one line
    (tmp_path / "nowhere").mkdir()
    r = subprocess.run([sys.executable, "-m", "builder", "lock", "--check"], cwd=tmp_path / "nowhere", env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "error: pins.toml: file not found", r.stderr
