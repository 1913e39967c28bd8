"""overlay4 and overlay5 of the vLLM lanes (recipes.md §12, §16 row 11): FlashInfer's SM120 kernels compiled into
the image's FlashInfer cache at build time, and the check that a fresh process then compiles nothing.

    python3 -B flashinfer-prebuild.py build mxfp8        overlay4: mxfp8_gemm_cutlass_sm120 (MAX_JOBS from the env)
    python3 -B flashinfer-prebuild.py build sparse_mla   overlay5: sparse_mla_sm120
    python3 -B flashinfer-prebuild.py verify             overlay5's gate: both load and nothing compiles

The recipe's build_overlay4.sh, build_overlay5.sh and prewarm5.py are UNKNOWN. The two kernels' entry points are the
ones its verify5.py loads (tonyd2wild/DeepSeek-V4.1-Flash-vLLM-DGX-Spark@557df4ec build/verify5.py):
``flashinfer.jit.gemm.gen_gemm_sm120_module_cutlass_mxfp8`` (a JIT spec: ``is_compiled``, ``build_and_load``) and
``flashinfer.mla._sparse_mla_sm120.get_sparse_mla_sm120_module`` (builds when needed, then loads). verify5.py's gate
is ``is_compiled`` plus a load in under 15 s, run with a GPU. The build has no GPU, and loading a module may need the
driver, so without one a load that fails after its compile is reported, not fatal; the gate is then what can be
proven without a GPU: the cache holds compiled modules, and loading both again in a new process adds or changes no
file of the cache (nothing compiled). With a GPU (``docker run --gpus all <image> python3 -B
/opt/builder-vllm/flashinfer-prebuild.py verify``) it is the recipe's gate: any load failure or a slow load fails.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: name -> (module, function, what the function returns: a JIT "spec" or the loaded "module")
KERNELS: dict[str, tuple[str, str, str]] = {
    "mxfp8": ("flashinfer.jit.gemm", "gen_gemm_sm120_module_cutlass_mxfp8", "spec"),
    "sparse_mla": ("flashinfer.mla._sparse_mla_sm120", "get_sparse_mla_sm120_module", "module"),
}
#: files a cached build touches without compiling anything: ninja's bookkeeping, file locks
NOT_OUTPUTS = (".ninja_log", ".ninja_deps", ".lock")
SLOW_LOAD_S = 15.0  # verify5.py: a load this slow compiled something

Snapshot = dict[str, tuple[int, int]]


def cache_roots() -> list[Path]:
    """FlashInfer's JIT cache: the folders its env module names, and the default under the home folder."""
    roots: set[Path] = set()
    try:
        env = importlib.import_module("flashinfer.jit.env")
        for attr in ("FLASHINFER_WORKSPACE_DIR", "FLASHINFER_JIT_DIR", "FLASHINFER_BASE_DIR"):
            value = getattr(env, attr, None)
            if value:
                roots.add(Path(value))
    except ImportError:
        pass
    roots.add(Path(os.environ.get("FLASHINFER_WORKSPACE_BASE") or Path.home()) / ".cache" / "flashinfer")
    return sorted(roots)


def snapshot() -> Snapshot:
    out: Snapshot = {}
    for root in cache_roots():
        for dirpath, _, files in os.walk(root):
            for fn in files:
                if fn.endswith(NOT_OUTPUTS):
                    continue
                p = os.path.join(dirpath, fn)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                out[p] = (st.st_size, st.st_mtime_ns)
    return out


def changed(before: Snapshot, after: Snapshot) -> list[str]:
    return sorted(p for p, v in after.items() if before.get(p) != v)


def is_compiled(spec: Any) -> bool | None:
    ic = getattr(spec, "is_compiled", None)
    return bool(ic()) if callable(ic) else (None if ic is None else bool(ic))


def has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def entry(name: str) -> tuple[Callable[[], Any], str]:
    module, func, kind = KERNELS[name]
    return getattr(importlib.import_module(module), func), kind  # an import error is fatal: say so as it is


def load(name: str) -> tuple[float, BaseException | None, bool | None]:
    """Build if needed and load one kernel module: (seconds, the error if it failed, is_compiled of a spec)."""
    fn, kind = entry(name)
    spec: Any = None
    err: BaseException | None = None
    t = time.monotonic()
    try:
        if kind == "spec":
            spec = fn()
            spec.build_and_load()
        else:
            fn()
    except Exception as e:  # reported, then judged by the caller
        err = e
    dt = time.monotonic() - t
    return dt, err, (is_compiled(spec) if spec is not None else None)


def short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def build(name: str) -> int:
    before = snapshot()
    dt, err, compiled = load(name)
    new = changed(before, snapshot())
    new_so = [p for p in new if p.endswith(".so")]
    print(f"PREBUILD {name}: {dt:.1f}s, {len(new)} cache files written ({len(new_so)} .so), is_compiled={compiled}",
          flush=True)
    for p in new_so:
        print(f"PREBUILD {name}: {p}", flush=True)
    if err is None:
        return 0
    if compiled is False or (compiled is None and not new_so):
        print(f"PREBUILD {name}: FAILED, nothing compiled: {short(err)}", file=sys.stderr)
        return 1
    if has_gpu():
        print(f"PREBUILD {name}: FAILED to load with a GPU: {short(err)}", file=sys.stderr)
        return 1
    print(f"PREBUILD {name}: compiled; the load needs a GPU, none here ({short(err)})", flush=True)
    return 0


def verify() -> int:
    gpu = has_gpu()
    start = snapshot()
    if not any(p.endswith(".so") for p in start):
        print(f"VERIFY: FAILED: no compiled module in FlashInfer's cache ({', '.join(map(str, cache_roots()))})",
              file=sys.stderr)
        return 1
    bad = 0
    for name in KERNELS:
        before = snapshot()
        dt, err, compiled = load(name)
        new = changed(before, snapshot())
        hit = not new and compiled is not False and (err is None or not gpu) and (dt < SLOW_LOAD_S or not gpu)
        note = "" if err is None else f", load: {short(err)}" + ("" if gpu else " (no GPU here)")
        print(f"VERIFY {name}: {'HIT' if hit else 'MISS'} {dt:.1f}s (is_compiled={compiled}{note})", flush=True)
        for p in new:
            print(f"VERIFY {name}: compiled at run time: {p}", flush=True)
        bad += not hit
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["build"] and len(argv) == 2 and argv[1] in KERNELS:
        return build(argv[1])
    if argv == ["verify"]:
        return verify()
    print(f"usage: flashinfer-prebuild.py build {{{','.join(KERNELS)}}} | verify", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
