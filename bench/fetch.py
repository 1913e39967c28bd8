"""(h) `builder fetch` from the FAKE Hub on loopback against `hf download` (huggingface_hub's own CLI):
the same files, the same server, in the same process run. builder downloads through huggingface_hub
(`hf_hub_download` into the HF cache), reads each LFS file behind huggingface_hub's writer to check its
sha256 against the lock as it lands, and hard-links it into its store; `hf download` does not hash what
it writes, so the ratio is what that verification costs. Each builder run starts from an empty HF cache
(its own HF_HOME, removed with its store): a run never finds the files an earlier run downloaded."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

from bench.common import Config, GiB, MiB, Row, gib_s, have, judge, secs, skipped
from bench.common import run as run_cmd
from tests.lib.fakehub import FakeHub  # a fake named as such: the Hub's HTTP protocol on 127.0.0.1

NAME = "fetch"


def run(cfg: Config) -> list[Row]:
    if not have("hf"):
        return [skipped(NAME, "fetch vs hf download", "huggingface_hub's `hf` CLI not on PATH", ">= 1.0")]
    total = (256 * MiB) if cfg.quick else 4 * GiB
    nfiles = 4 if cfg.quick else 8
    size = total // nfiles
    files = {f"model-{i:05d}-of-{nfiles:05d}.safetensors": os.urandom(1024) * (size // 1024) for i in range(nfiles)}
    files["config.json"] = b'{"bench": true}\n'
    work = cfg.workdir / "fetch"
    work.mkdir(parents=True, exist_ok=True)
    with FakeHub() as hub:
        commit = hub.add_repo("bench/model", files, lfs={p for p in files if p.endswith(".safetensors")})
        proj = work / "proj"
        proj.mkdir(exist_ok=True)
        (proj / "pins.toml").write_text('format = 1\n\n[models.m]\nrepo = "bench/model"\nrevision = "main"\n')
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "BUILDER_"))}
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(work / "hf-home"), NO_COLOR="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        py = [sys.executable, "-m", "builder", "--pins", str(proj / "pins.toml")]
        run_cmd([*py, "--store", str(work / "lockcache"), "lock", "m"], env=env)
        times: dict[str, list[float]] = {"builder": [], "hf": []}
        for _ in range(cfg.n(3)):  # 4 GiB through a Python server: three interleaved runs each
            for tool in ("builder", "hf"):
                out = work / f"out-{tool}"
                shutil.rmtree(out, ignore_errors=True)
                t = time.perf_counter()
                if tool == "builder":
                    run_cmd([*py, "--store", str(out), "fetch", "m", "--jobs", "8"],
                            env={**env, "HF_HOME": str(out / "hf-home")})
                else:
                    run_cmd(["hf", "download", "bench/model", "--revision", commit, "--local-dir", str(out),
                         "--max-workers", "8"], env=env)
                times[tool].append(time.perf_counter() - t)
                shutil.rmtree(out, ignore_errors=True)
    b, h = statistics.median(times["builder"]), statistics.median(times["hf"])
    ratio = h / b
    note = f"{nfiles} files, {total / GiB:.2f} GiB, every byte sha256-verified by builder"
    return [Row(bench=NAME, figure="fetch (verified) vs hf download", builder=f"{secs(b)} ({gib_s(total, b)})",
                standard=f"{secs(h)} ({gib_s(total, h)})", ratio=ratio, target=">= 1.0",
                status=judge(ratio, ">= 1.0"), note=note, values={"builder_s": times["builder"], "hf_s": times["hf"]})]


