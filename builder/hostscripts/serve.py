"""On a host: ask the lane's API what the serving checks need: /health, /v1/models, a one-token completion.

argv[1] is JSON ``{"base": "http://127.0.0.1:PORT", "model": served name, "timeout": seconds}``.
Prints JSON ``{"health"|"models"|"completion": {"status": HTTP status, "body": text}}``, or
``{"status": code or null, "error": why}`` for a call that failed. Run on the head itself: the API
may listen on loopback only.

Standard library only: it runs as ``python3 -I -S -c SOURCE ARG`` (builder.hostscripts.source).
"""

from __future__ import annotations

import json
import sys
import urllib.request

#: urllib without proxies: a host's http_proxy must not carry a request for the lane's own address
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def call(base: str, path: str, timeout: float, body: object = None) -> dict[str, object]:
    try:
        data = None if body is None else json.dumps(body).encode()
        r = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
        with LOCAL.open(r, timeout=timeout) as resp:
            return {"status": resp.status, "body": resp.read(1 << 20).decode("utf-8", "replace")}
    except Exception as e:  # every failure is an answer: the check says what it found
        return {"status": getattr(e, "code", None), "error": str(e)[:200]}


def main(argv: list[str]) -> int:
    req = json.loads(argv[1])
    base, timeout = str(req["base"]), float(req["timeout"])
    completion = {"model": req["model"], "prompt": "Say OK.", "max_tokens": 1, "temperature": 0}
    out = {
        "health": call(base, "/health", timeout),
        "models": call(base, "/v1/models", timeout),
        "completion": call(base, "/v1/completions", timeout, completion),
    }
    sys.stdout.write(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
