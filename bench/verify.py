"""(a) Model folder verification vs openssl dgst and sha256sum: full mode is builder.foundation.hashing's
hash_folder_files (what `builder lock` hashes a local model folder with), each digest against the expected
one; fast mode is the installer's check of each file against the apply record an install wrote
(builder.installer.record.model_ok and model_records)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from bench.common import Config, Row, gib_s, have, judge, median_interleaved, secs, skipped, warm
from bench.data import model_folder
from builder.foundation import hashing
from builder.installer.record import model_ok, model_records

NAME = "verify"


def _tool(argv: list[str]) -> None:
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)


def run(cfg: Config) -> list[Row]:
    mf = model_folder(cfg)
    warm(mf.paths)
    paths = [str(p) for p in mf.paths]
    rows: list[Row] = []

    names = [e[0] for e in mf.entries]

    def full() -> None:
        got = hashing.hash_folder_files(mf.root, names, where="model")
        assert got == [(n, digest, size) for n, size, digest in mf.entries], got

    contenders = {"builder": full}
    if have("openssl"):
        contenders["openssl"] = lambda: _tool(["openssl", "dgst", "-sha256", *paths])
    if have("sha256sum"):
        contenders["sha256sum"] = lambda: _tool(["sha256sum", *paths])
    t = median_interleaved(contenders, cfg.runs)
    size_note = f"{len(paths)} files, {mf.total / 2**30:.2f} GiB, warm cache, {hashing.default_workers()} threads"
    for tool, target in (("openssl", ">= 1.7"), ("sha256sum", "")):
        fig = f"folder full verify vs {tool} dgst" if tool == "openssl" else f"folder full verify vs {tool}"
        if tool not in t:
            rows.append(skipped(NAME, fig, f"{tool} not installed", target))
            continue
        ratio = t[tool] / t["builder"]
        rows.append(Row(NAME, fig, gib_s(mf.total, t["builder"]), gib_s(mf.total, t[tool]),
                        ratio, target, judge(ratio, target), size_note,
                        {"builder_s": t["builder"], f"{tool}_s": t[tool], "bytes": mf.total}))

    # One large file: a single thread of builder's read loop against openssl on the same file.
    big = paths[0]
    size = mf.entries[0][1]
    single: dict[str, Callable[[], object]] = {"builder": lambda: hashing.sha256_file(big)}
    if have("openssl"):
        single["openssl"] = lambda: _tool(["openssl", "dgst", "-sha256", big])
        t1 = median_interleaved(single, cfg.runs)
        ratio = t1["openssl"] / t1["builder"]
        rows.append(Row(NAME, "single file sha256 vs openssl dgst", gib_s(size, t1["builder"]),
                        gib_s(size, t1["openssl"]), ratio, ">= 0.95", judge(ratio, ">= 0.95"),
                        f"one {size / 2**20:.0f} MiB file, {hashing.READ_SIZE >> 20} MiB reads",
                        {"builder_s": t1["builder"], "openssl_s": t1["openssl"], "bytes": size}))
    else:
        rows.append(skipped(NAME, "single file sha256 vs openssl dgst", "openssl not installed", ">= 0.95"))

    # Fast mode against the record an install writes once the files are in place.
    models = [{"path": str(mf.root / n), "size": size, "sha256": digest} for n, size, digest in mf.entries]
    record = {"models": model_records({"models": models})}

    def fast() -> None:
        probs = [why for m in models if (why := model_ok(m, record)) is not None]
        assert not probs, probs

    tf = median_interleaved({"fast": fast}, max(cfg.runs, 20), warmup=3)["fast"]
    ratio = t["builder"] / tf
    rows.append(Row(NAME, "fast mode vs full mode (same folder)", secs(tf), f"full {secs(t['builder'])}",
                    ratio, ">= 100", judge(ratio, ">= 100"),
                    "fast = size+mtime+inode vs the apply record; trusts the file system",
                    {"fast_s": tf, "full_s": t["builder"]}))
    return rows
