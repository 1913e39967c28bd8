"""In a lane's image (or on a host with torch): a bounded matrix-product load on GPU 0, timed.

The burn gate's default load (recipes.md §14 #5: a 10 to 15 s fp16 4096² matmul) and, with
``hold_gib``, a load that also holds GPU memory. argv[1] is a JSON request::

    {"seconds": 12, "size": 4096, "dtype": "fp16", "hold_gib": 0, "device": 0}

Prints one JSON line when done: ``{"tflops", "iters", "seconds", "size", "dtype", "device_name"}``
(tflops: 2·size³ per product, over the wall time of the timed products, synchronised), or
``{"error": why}`` with exit status 1 when torch or the GPU is missing. It needs torch, so it runs as
``python3 -c SOURCE ARG`` (not with -I -S, as the fact modules do), by the burn command that the
host's profile names (builder.gpu.burn).
"""

from __future__ import annotations

import json
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

DTYPES = ("fp16", "bf16", "fp32")


def request(argv: list[str]) -> dict[str, Any]:
    req: dict[str, Any] = {"seconds": 12.0, "size": 4096, "dtype": "fp16", "hold_gib": 0.0, "device": 0}
    if len(argv) > 1:
        req.update(json.loads(argv[1]))
    if req["dtype"] not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {req['dtype']!r}")
    if not 0 < float(req["seconds"]) <= 3600 or not 16 <= int(req["size"]) <= 65536:
        raise ValueError("seconds: expected 0 < s <= 3600 and size 16..65536")
    return req


def tflops(size: int, iters: int, seconds: float) -> float:
    """Achieved TFLOPS of `iters` products of two size×size matrices in `seconds`."""
    return 2.0 * size**3 * iters / seconds / 1e12 if seconds > 0 else 0.0


def burn(req: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - needs torch and a GPU
    import torch

    if not torch.cuda.is_available():
        return {"error": "torch sees no CUDA device"}
    dev = torch.device("cuda", int(req["device"]))
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[req["dtype"]]
    n = int(req["size"])
    held = None
    if float(req["hold_gib"]) > 0:  # (a plain allocation: device memory, never managed)
        held = torch.empty(int(float(req["hold_gib"]) * (1 << 30)), dtype=torch.uint8, device=dev)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    c = torch.empty(n, n, device=dev, dtype=dtype)
    for _ in range(5):  # warm-up: cuBLAS picks its kernel, the clocks rise
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize(dev)
    # products in batches between synchronisations, so the clock is read about every 0.1 s or less
    batch, iters, t0 = 16, 0, time.perf_counter()
    deadline = t0 + float(req["seconds"])
    while True:
        for _ in range(batch):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize(dev)
        iters += batch
        now = time.perf_counter()
        if now >= deadline:
            break
    elapsed = now - t0
    del held
    return {
        "tflops": round(tflops(n, iters, elapsed), 2),
        "iters": iters,
        "seconds": round(elapsed, 3),
        "size": n,
        "dtype": req["dtype"],
        "device_name": torch.cuda.get_device_name(dev),
    }


def main(argv: list[str]) -> int:  # pragma: no cover - needs torch and a GPU
    try:
        req = request(argv)
        out = burn(req)
    except (ValueError, ImportError, RuntimeError) as e:
        out = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    print(json.dumps(out), flush=True)
    return 1 if "error" in out else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv))
