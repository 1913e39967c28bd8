"""Progress bars (builder.output.progress): drawn on a terminal only, on stderr; stdout stays data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from builder.output import fit
from tests.lib import auditlib, clirun, factory, ptylib
from tests.lib import bundlelib as bl
from tests.lib.fakehub import FakeHub


def _run_on_pty(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    rc, out, drawn = ptylib.run_on_pty(argv, cwd)
    return rc, out, drawn.decode("utf-8", "replace")


def test_no_bar_off_a_terminal_and_json_stays_one_document(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path)
    r = p.cli("bundle", "spark-b", "--with-models", "--key", str(p.key), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["host"] == "spark-b"
    # one line of progress's end and the key it signed with: no bar, no escape
    assert "\r" not in r.stderr and "\x1b" not in r.stderr and r.stderr.count("\n") == 2, r.stderr
    assert r.stderr.splitlines()[1].startswith("signed with "), r.stderr
    r = p.cli("verify", str(p.out("spark-b")), "--key", str(p.pub), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True, r.stderr
    assert "\x1b" not in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_on_a_terminal_the_bar_goes_to_stderr_only(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path)
    argv = [*clirun.ARGV, "--pins", str(p.pins), "bundle", "--fleet", bl.FLEET, "--with-models",
            "--key", str(p.key), "--json"]
    rc, out, tty = _run_on_pty(argv, p.root)
    assert rc == 0, tty
    assert [b["host"] for b in json.loads(out)] == ["spark-a", "spark-b"]  # stdout: the data alone


def test_a_long_job_draws_bytes_rate_and_time_left_on_the_terminal(tmp_path: Path) -> None:
    code = (
        "import time\n"
        "from builder import output\n"
        "with output.progress(delay=0.1) as bar:\n"
        "    step = output.byte_counter(bar, 'bundle testfleet/spark-b', 64 << 20)\n"
        "    for _ in range(8):\n"
        "        time.sleep(0.1)\n"
        "        step(4 << 20)\n"
        "print('done')\n"
    )
    rc, out, tty = _run_on_pty([sys.executable, "-c", code], tmp_path)
    assert rc == 0 and out == "done\n", tty
    assert "bundle testfleet/spark-b" in tty and "MB" in tty and "\x1b[" in tty  # drawn on stderr only


def test_progress_without_a_terminal_draws_nothing() -> None:
    code = (
        "from builder import output\n"
        "with output.progress() as bar:\n"
        "    output.byte_counter(bar, 'x', 10)(5)\n"
        "print('done')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "done\n" and r.stderr == "", r.stderr


def _slow_unreachable_fleet(tmp_path: Path) -> Path:
    """An audit project whose two hosts take 4 s to turn out unreachable (their ssh ProxyCommand
    waits, then fails): a full-mode audit that lasts past the bars' delay without any host."""
    paths = auditlib.make_project(tmp_path / "proj")
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host *\n  ProxyCommand sh -c 'sleep 4; exit 1'\n")
    hosts = [{"name": "a", "ssh": "node-a", "rank": 0, "role": "head"},
             {"name": "b", "ssh": "node-b", "rank": 1, "role": "worker"}]
    (paths["hosts"] / "f.toml").write_text(auditlib.fleet_toml("f", hosts, ssh_config=str(cfg)))
    return paths["pins"]


def test_full_audit_draws_one_bar_per_host_on_a_terminal_only(tmp_path: Path) -> None:
    pins = _slow_unreachable_fleet(tmp_path)
    argv = [*clirun.ARGV, "--pins", str(pins), "audit", "--fleet", "f", "--mode", "full", "--json"]
    rc, out, tty = _run_on_pty(argv, pins.parent)
    assert rc == 3, tty
    assert sorted(json.loads(out)["hosts"]) == ["a", "b"]  # stdout: one JSON document
    assert "audit a (full)" in tty and "audit b (full)" in tty and "\x1b[" in tty
    r = subprocess.run(argv, cwd=pins.parent, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ))
    assert r.returncode == 3 and len(json.loads(r.stdout)["hosts"]) == 2
    assert "(full)" not in r.stderr and "\x1b" not in r.stderr and "\r" not in r.stderr, r.stderr


#: `builder` with its progress bars drawn at once (not after 3 s), for jobs a test keeps short
#: the builder CLI with its progress drawn at once (tests/lib/builder_now.py)
NO_DELAY = ["-m", "tests.lib.builder_now"]


def _big_local_model(p: bl.Project) -> None:
    """A local model file big enough that hashing it takes a few refreshes of the bar (a plain
    folder, so the pin names its commit)."""
    factory.edit_pins(p.root, lambda d: d["models"]["demo-model"].update(revision="a" * 40))
    with open(p.root / "models" / "demo" / "big.safetensors", "wb") as f:
        f.truncate(512 << 20)


def test_lock_hashing_local_models_draws_a_bar_on_a_terminal_only(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path)
    _big_local_model(p)
    args = ["--pins", str(p.pins), "lock", "--offline", "--update", "demo-model", "--json"]
    rc, out, tty = _run_on_pty([sys.executable, *NO_DELAY, *args], p.root)
    assert rc == 0, tty
    assert json.loads(out)["resolved"] == ["models.demo-model"]  # stdout: one JSON document
    assert "hash models.demo-model" in tty and "MB" in tty and "\x1b[" in tty
    r = subprocess.run([sys.executable, *NO_DELAY, *args], cwd=p.root, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ))
    assert r.returncode == 0 and json.loads(r.stdout)["written"] is False, r.stderr
    assert "hash models" not in r.stderr and "\x1b" not in r.stderr and "\r" not in r.stderr, r.stderr


def _one_line_each(tty: bytes | str, columns: int = 80) -> list[str]:
    """The bars drawn, each checked to fit the terminal (none wraps onto a second line)."""
    lines = [ln for ln in ptylib.screen_lines(tty.encode() if isinstance(tty, str) else tty) if "\u2501" in ln]
    assert lines and all(len(ln) < columns for ln in lines), [ln for ln in lines if len(ln) >= columns]
    return lines


def test_fetch_names_the_files_in_flight_with_bytes_rate_and_time_left_in_80_columns(tmp_path: Path) -> None:
    files = {f"model-{i:05d}-of-00004.safetensors": os.urandom(1 << 20) * 40 for i in range(4)}
    repo = "deepseek-ai/DeepSeek-V4-Flash-Base"
    pins = factory.write_pins(tmp_path, factory.pins(models={"deepseek-v4-flash": factory.model(repo)}))
    with FakeHub() as hub:
        hub.add_repo(repo, files, lfs=set(files))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "BUILDER_"))}
        env.update(BUILDER_STORE=str(tmp_path / "store"), HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=hub.url)
        lock = clirun.run("lock", pins=pins, env=clirun.environment(base=env), timeout=120)
        assert lock.returncode == 0, lock.stderr
        argv = [sys.executable, *NO_DELAY, "--pins", str(pins), "fetch", "deepseek-v4-flash", "--jobs", "2",
                "--json"]
        rc, out, tty = ptylib.run_on_pty(argv, tmp_path, columns=80, env=env)
    assert rc == 0, tty
    assert len(json.loads(out)["downloaded"]) == 4  # stdout: the data alone
    lines = _one_line_each(tty)
    bars = [ln for ln in lines if "MB" in ln]
    assert not any("None" in ln for ln in lines)
    # the label names what is in flight (two at once: "+1"), by its shard's own name
    assert any(re.match(r"get model-0000[0-3]-of.*\+1 ", ln) for ln in bars), bars
    assert any(re.search(r"\d+\.\d/167\.8 MB +\d+\.\d MB/s 0:00:\d\d$", ln) for ln in bars), bars


def test_verify_of_a_large_bundle_draws_a_bar_by_bytes(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path)
    _big_local_model(p)
    r = p.cli("lock", "--offline", "--update", "demo-model")
    assert r.returncode == 0, r.stderr
    bl.write_record_for(p.root, p.image_id, p.diff_ids)  # the image, recorded for the new lock
    args = ["--pins", str(p.pins), "bundle", "spark-b", "--with-models", "--key", str(p.key), "--json"]
    rc, out, tty = ptylib.run_on_pty([sys.executable, *NO_DELAY, *args], p.root, columns=80)
    assert rc == 0, tty
    bars = [ln for ln in _one_line_each(tty) if "MB" in ln]
    # the store hashes the model as it takes it in: the bar moves with those bytes, at a rate
    rated = [ln for ln in bars if re.search(r"\d [MG]B/s 0:00:\d\d$", ln)]
    assert any(ln.startswith("bundle testfleet/spark-b") for ln in rated), bars
    args = ["--pins", str(p.pins), "verify", str(p.out("spark-b")), "--key", str(p.pub), "--json"]
    rc, out, tty = ptylib.run_on_pty([sys.executable, *NO_DELAY, *args], p.root, columns=80)
    assert rc == 0 and json.loads(out)["ok"] is True, tty
    bars = [ln for ln in _one_line_each(tty) if "MB" in ln]
    assert any(ln.startswith("verify spark-b") and re.search(r"/5\d\d\.\d MB", ln) for ln in bars), bars


def test_labels_keep_the_verb_the_count_and_the_files_own_name() -> None:
    text = "get deepseek-v4-flash/model-00001-of-00163.safetensors +3"
    assert fit(text, 80) == text
    assert fit(text, 30) == "get model-00001-of-…tensors +3"
    assert fit("get tiny/some/deeper/folder/config.json", 30) == "get …deeper/folder/config.json"
    assert fit("bundle spark-tp4/spark-1", 20) == "bundle …-tp4/spark-1"
    for width in range(8, 60):
        assert len(fit(text, width)) <= width
