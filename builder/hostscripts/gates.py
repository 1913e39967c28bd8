"""On a host: the lane's serving gates, its replay prompts and its speed check, asked of the lane's API.

argv[1] is JSON ``{"base": "http://127.0.0.1:PORT", "model": served name, "gates": the lane's gates
(builder.inputs.lanes.Gates as JSON)}``. Prints JSON::

    {"gates": {NAME: {"ok": bool, "why": text, "prompt": text, "got": text}},
     "replay": [{"prompt": text, "ids": [int] | null, "token_sha": 12 hex, "text": text}],
     "speed": {"tok_s": float, "tokens": int, "seconds": float} | null}

Every question is a chat turn at T=0 (``/v1/chat/completions``), as the lane's real traffic is: the
recipes' gates (recipes.md §15: tools/gates.py, concurrent_check.py, exact.py, the count check) and the
garble gate over every reply. ``token_sha`` is the recipes' own: the first 12 hex of sha256 over the
comma-joined token ids (over the text where the engine returns no ids). Run on the head itself: the API
may listen on loopback only.

Standard library only: it runs as ``python3 -I -S -c SOURCE ARG`` (builder.hostscripts.source).
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

#: urllib without proxies: a host's http_proxy must not carry a request for the lane's own address
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))
#: markup of the engines' tool-call templates that must never reach a reply's content (hermes, DeepSeek's DSML)
MARKUP = ("<tool_call>", "</tool_call>", "<|tool", "<｜DSML｜", "<｜tool", "<function=", "<|im_start|>", "<|im_end|>")
#: a reply of at least this many tokens that is one token repeated is garbled
GARBLE_MIN = 4


class Failed(Exception):
    """A call the gate could not make (HTTP error, bad JSON): the gate fails with this text."""


# ----------------------------------------------------------------------------------------- judging


def token_sha(ids: list[int] | None, text: str) -> str:
    """The recipes' token_sha: sha256 over the comma-joined ids, first 12 hex (over the text without ids)."""
    data = ",".join(str(i) for i in ids) if ids is not None else text
    return hashlib.sha256(data.encode()).hexdigest()[:12]


def garbled(text: str, ids: list[int] | None) -> str:
    """Why a reply is garbage (one token repeated, or not valid text), or "" when it reads as text."""
    if "\ufffd" in text:
        return "not valid text (U+FFFD in the reply)"
    if any(ord(c) < 32 and c not in "\n\t\r" for c in text):
        return "not valid text (control characters in the reply)"
    if ids is not None and len(ids) >= GARBLE_MIN and len(set(ids)) == 1:
        return f"one token repeated ({len(ids)} x id {ids[0]})"
    words = text.split()
    if len(words) >= GARBLE_MIN and len(set(words)) == 1:
        return f"one token repeated ({len(words)} x {words[0]!r})"
    s = text.strip()
    for n in range(1, len(s) // GARBLE_MIN + 1):  # (a token repeated with no space between: "!!!!")
        if s == s[:n] * (len(s) // n):
            return f"one token repeated ({len(s) // n} x {s[:n]!r})"
    return ""


def leaked(text: str) -> str:
    """Template markup found in a reply's content, or ""."""
    return next((m for m in MARKUP if m in text), "")


# ------------------------------------------------------------------------------------------- calls


def post(base: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with LOCAL.open(req, timeout=timeout) as resp:
            got: dict[str, Any] = json.loads(resp.read(8 << 20))
            return got
    except Exception as e:  # every failure is an answer: the gate says what it found
        raise Failed(_why(e)) from None


def stream(base: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """A streamed request, its chunks joined: content, reasoning, tool calls, ids, finish reason, and
    when the first and last token arrived."""
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    out: dict[str, Any] = {"content": "", "reasoning": "", "tool_calls": {}, "ids": [], "finish": None,
                           "chunks": 0, "first": None, "last": None}
    has_ids = False
    try:
        with LOCAL.open(req, timeout=timeout) as resp:
            for chunk in _events(resp):
                for ch in chunk.get("choices") or []:
                    has_ids = _add_delta(out, ch) or has_ids
                out["chunks"] += 1
    except Failed:
        raise
    except Exception as e:
        raise Failed(_why(e)) from None
    if not has_ids:
        out["ids"] = None
    out["tool_calls"] = [out["tool_calls"][k] for k in sorted(out["tool_calls"])]
    return out


def _events(resp: Any) -> Iterator[dict[str, Any]]:
    """Each server-sent event's JSON (its ``data:`` line), up to ``[DONE]``."""
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _add_delta(out: dict[str, Any], ch: dict[str, Any]) -> bool:
    """One streamed choice's delta joined onto ``out`` (and when a token came); whether it carried token ids."""
    d = ch.get("delta") or {}
    now = time.monotonic()
    if d.get("content") or d.get("reasoning_content") or d.get("reasoning") or d.get("tool_calls"):
        out["first"] = out["first"] or now
        out["last"] = now
    out["content"] += d.get("content") or ""
    out["reasoning"] += d.get("reasoning_content") or d.get("reasoning") or ""
    for tc in d.get("tool_calls") or []:
        slot = out["tool_calls"].setdefault(tc.get("index", 0), {"name": "", "arguments": ""})
        fn = tc.get("function") or {}
        slot["name"] += fn.get("name") or ""
        slot["arguments"] += fn.get("arguments") or ""
    out["finish"] = ch.get("finish_reason") or out["finish"]
    if ch.get("token_ids") is not None:
        out["ids"] += list(ch["token_ids"])
        return True
    return False


def _why(e: Exception) -> str:
    code = getattr(e, "code", None)
    body = ""
    if code is not None:
        try:
            body = e.read(600).decode("utf-8", "replace")  # type: ignore[attr-defined]
        except Exception:
            body = ""
    return (f"HTTP {code}: {body.strip()[:300]}" if code is not None else f"{type(e).__name__}: {e}")[:400]


def reply(resp: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed response's first choice: content, reasoning, tool calls, ids, finish reason."""
    choices = resp.get("choices") or []
    if not choices:
        raise Failed(f"no choices in the reply: {json.dumps(resp)[:200]}")
    ch = choices[0]
    msg = ch.get("message") or {}
    calls = [{"name": (c.get("function") or {}).get("name") or "", "arguments": (c.get("function") or {}).get(
        "arguments") or ""} for c in msg.get("tool_calls") or []]
    ids = ch.get("token_ids")
    return {"content": msg.get("content") or "", "reasoning": msg.get("reasoning_content") or msg.get("reasoning")
            or "", "tool_calls": calls, "ids": list(ids) if ids is not None else None,
            "finish": ch.get("finish_reason")}


# ------------------------------------------------------------------------------------------- gates


class Gates:
    def __init__(self, base: str, model: str, g: dict[str, Any]) -> None:
        self.base, self.model, self.g = base, model, g
        self.timeout = float(g.get("timeout", 120))
        self.results: dict[str, dict[str, Any]] = {}
        self.garbled: list[str] = []

    def body(self, prompt: str | list[dict[str, Any]], max_tokens: int | None = None, **extra: Any) -> dict[str, Any]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        b: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": 0,
                             "max_tokens": max_tokens or int(self.g.get("max_tokens", 32))}
        if self.g.get("token_ids", True):
            b["return_token_ids"] = True
        b.update(self.g.get("request") or {})
        b.update(extra)
        return b

    def ask(self, prompt: str | list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        r = reply(post(self.base, self.body(prompt, **extra), self.timeout))
        self.judge(prompt, r)
        return r

    def ask_streamed(self, prompt: str | list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        r = stream(self.base, self.body(prompt, **extra), self.timeout)
        self.judge(prompt, r)
        return r

    def judge(self, prompt: str | list[dict[str, Any]], r: dict[str, Any]) -> None:
        why = garbled(r["content"], r["ids"]) if r["content"] or r["ids"] else ""
        if why:
            self.garbled.append(f"{_short(prompt)!r}: {why}: {r['content'][:80]!r}")

    def gate(self, name: str, prompt: str, fn: Any) -> None:
        """Run one gate: ``fn()`` returns (ok, why, got)."""
        try:
            ok, why, got = fn()
        except Failed as e:
            ok, why, got = False, str(e), ""
        self.results[name] = {"ok": bool(ok), "why": why, "prompt": prompt, "got": str(got)[:300]}

    # -- each gate ---------------------------------------------------------------------------------

    def models(self) -> tuple[bool, str, str]:
        try:
            with LOCAL.open(self.base + "/v1/models", timeout=self.timeout) as resp:
                body = json.loads(resp.read(1 << 20))
        except Exception as e:
            return False, _why(e), ""
        ids = [m.get("id") for m in body.get("data") or [] if isinstance(m, dict)]
        missing = [n for n in [self.model, *self.g.get("aliases", [])] if n not in ids]
        return not missing, f"/v1/models does not list {missing}" if missing else "", ", ".join(map(str, ids))

    def chat_probe(self) -> tuple[bool, str, str]:
        p = self.g["chat_probe"]
        r = self.ask(p["prompt"])
        ok = p["expect"] in r["content"]
        return ok, "" if ok else f"expected {p['expect']!r} in the reply", r["content"]

    def reasoning_stream(self) -> tuple[bool, str, str]:
        p = (self.g.get("chat_probe") or {}).get("prompt") or "17*19="
        r = self.ask_streamed(p, **(self.g.get("reasoning_request") or {}))
        missing = [k for k, v in (("reasoning_content", r["reasoning"]), ("content", r["content"])) if not v]
        return not missing, f"no {' or '.join(missing)} arrived" if missing else "", (
            f"reasoning {r['reasoning'][:60]!r}, content {r['content'][:60]!r}")

    def _tools(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        t = self.g["tools"]
        tool = {"type": "function", "function": {
            "name": t["name"], "description": t.get("description") or "",
            "parameters": {"type": "object", "properties": {k: {"type": "string"} for k in t["arguments"]},
                           "required": sorted(t["arguments"])}}}
        return t, [tool]

    def _call_ok(self, t: dict[str, Any], r: dict[str, Any]) -> tuple[bool, str, str]:
        got = f"content {r['content'][:60]!r}, tool_calls {json.dumps(r['tool_calls'])[:160]}"
        if leaked(r["content"]):
            return False, f"template markup {leaked(r['content'])!r} in the content", got
        if not r["tool_calls"]:
            return False, f"no tool call (finish_reason {r['finish']!r})", got
        call = r["tool_calls"][0]
        try:
            args = json.loads(call["arguments"] or "{}")
        except ValueError:
            return False, "the tool call's arguments are not JSON", got
        if call["name"] != t["name"] or args != t["arguments"]:
            return False, f"expected {t['name']}({json.dumps(t['arguments'])})", got
        return True, "", got

    def tool_call(self) -> tuple[bool, str, str]:
        t, tools = self._tools()
        return self._call_ok(t, self.ask(t["prompt"], tools=tools, tool_choice="auto"))

    def tool_call_stream(self) -> tuple[bool, str, str]:
        t, tools = self._tools()
        return self._call_ok(t, self.ask_streamed(t["prompt"], tools=tools, tool_choice="auto"))

    def tool_result(self) -> tuple[bool, str, str]:
        t, tools = self._tools()
        turns = [
            {"role": "user", "content": t["prompt"]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_gate0", "type": "function", "function": {
                "name": t["name"], "arguments": json.dumps(t["arguments"])}}]},
            {"role": "tool", "tool_call_id": "call_gate0", "content": t["result"]},
        ]
        r = self.ask(turns, tools=tools, tool_choice="auto")
        if leaked(r["content"]):
            return False, f"template markup {leaked(r['content'])!r} in the content", r["content"]
        ok = t["expect"] in r["content"]
        return ok, "" if ok else f"the reply does not use the tool's result (expected {t['expect']!r})", r["content"]

    def drafted_equals_serial(self) -> tuple[bool, str, str]:
        p = self.g["replay"][0] if self.g.get("replay") else "17*19="
        a, b = self.ask(p, draft=True), self.ask(p, draft=False)
        return _same(a, b, "drafted", "serial (\"draft\": false)")

    def burst(self) -> tuple[bool, str, str]:
        n = int(self.g["burst"])
        p = (self.g.get("chat_probe") or {}).get("prompt") or "Say OK."
        got = self._at_once([p] * n)
        bad = [i for i, r in enumerate(got) if isinstance(r, str)]
        return not bad, f"{len(bad)} of {n} did not complete: {got[bad[0]] if bad else ''}", f"{n - len(bad)}/{n}"

    def concurrent_equals_solo(self) -> tuple[bool, str, str]:
        n = int(self.g["concurrent"])
        p = self.g["speed"]["prompt"] if self.g.get("speed") else "Count from 1 to 100, separated by spaces."
        solo = self.ask(p)
        got = self._at_once([p] * n)
        same = sum(1 for r in got if isinstance(r, dict) and _key(r) == _key(solo))
        ok = same == n
        first = next((r for r in got if not (isinstance(r, dict) and _key(r) == _key(solo))), None)
        why = "" if ok else f"{n - same} of {n} differ from the prompt alone: " + (
            first if isinstance(first, str) else _first_difference(solo, first or {}))
        return ok, why, f"{same}/{n} identical"

    def streamed_equals_plain(self) -> tuple[bool, str, str]:
        p = (self.g.get("chat_probe") or {}).get("prompt") or (self.g.get("replay") or ["Say OK."])[0]
        return _same(self.ask(p), self.ask_streamed(p), "non-streamed", "streamed")

    def _at_once(self, prompts: list[str]) -> list[dict[str, Any] | str]:
        out: list[dict[str, Any] | str] = ["not answered"] * len(prompts)
        start = threading.Barrier(len(prompts))

        def one(i: int) -> None:
            start.wait()
            try:
                out[i] = self.ask(prompts[i])
            except Failed as e:
                out[i] = str(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    # -- replay and speed ---------------------------------------------------------------------------

    def replay(self) -> list[dict[str, Any]]:
        out = []
        for p in self.g.get("replay") or []:
            try:
                r = self.ask(p)
                out.append({"prompt": p, "ids": r["ids"], "token_sha": token_sha(r["ids"], r["content"]),
                            "text": r["content"][:400]})
            except Failed as e:
                out.append({"prompt": p, "ids": None, "token_sha": None, "text": "", "error": str(e)})
        return out

    def speed(self) -> dict[str, Any] | None:
        s = self.g.get("speed")
        if not s:
            return None
        t0 = time.monotonic()
        try:
            r = self.ask_streamed(s["prompt"], max_tokens=int(s["max_tokens"]), stream_options={"include_usage": True})
        except Failed as e:
            return {"tok_s": None, "tokens": 0, "seconds": 0.0, "error": str(e)}
        t1 = time.monotonic()
        n = len(r["ids"]) if r["ids"] is not None else max(1, len(r["content"].split()))
        # decode rate: the tokens after the first over the time they took; a reply that arrived in one
        # piece (no spread to measure) counts the whole request instead
        span = (r["last"] or t1) - (r["first"] or t0)
        rate = (n - 1) / span if n > 1 and span > 0.005 else n / max(t1 - t0, 1e-6)
        return {"tok_s": round(rate, 1), "tokens": n, "seconds": round(t1 - t0, 3),
                "ttft": round((r["first"] or t1) - t0, 3)}

    def run(self) -> dict[str, Any]:
        g = self.g
        self.gate("models", "GET /v1/models", self.models)
        if g.get("chat_probe"):
            self.gate("chat_probe", g["chat_probe"]["prompt"], self.chat_probe)
        if g.get("reasoning"):
            self.gate("reasoning_stream", (g.get("chat_probe") or {}).get("prompt") or "17*19=", self.reasoning_stream)
        if g.get("tools"):
            p = g["tools"]["prompt"]
            self.gate("tool_call", p, self.tool_call)
            self.gate("tool_call_stream", p, self.tool_call_stream)
            self.gate("tool_result", p, self.tool_result)
        if g.get("draft_switch"):
            self.gate("drafted_equals_serial", (g.get("replay") or ["17*19="])[0], self.drafted_equals_serial)
        if g.get("burst"):
            self.gate("burst", f"{g['burst']} at once", self.burst)
        if g.get("concurrent"):
            self.gate("concurrent_equals_solo", f"{g['concurrent']} at once", self.concurrent_equals_solo)
        if g.get("streamed", True):
            self.gate("streamed_equals_plain", "stream: true and false", self.streamed_equals_plain)
        replay = self.replay()
        speed = self.speed()
        self.results["garble"] = {"ok": not self.garbled, "why": "; ".join(self.garbled[:3]),
                                  "prompt": "every reply", "got": f"{len(self.garbled)} garbled"}
        return {"gates": self.results, "replay": replay, "speed": speed}


def _key(r: dict[str, Any]) -> Any:
    return r["ids"] if r["ids"] is not None else r["content"]


def _first_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    x, y = _key(a), _key(b) if b else None
    if y is None:
        return "no reply"
    i = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
    return f"first difference at token {i}: {x[i] if i < len(x) else 'end'} against {y[i] if i < len(y) else 'end'}"


def _same(a: dict[str, Any], b: dict[str, Any], an: str, bn: str) -> tuple[bool, str, str]:
    ok = _key(a) == _key(b) and a["content"] == b["content"]
    why = "" if ok else f"{an} and {bn} differ: {_first_difference(a, b)}"
    return ok, why, f"{an} {a['content'][:60]!r}, {bn} {b['content'][:60]!r}"


def _short(prompt: str | list[dict[str, Any]]) -> str:
    if isinstance(prompt, str):
        return prompt[:60]
    return str((prompt[0] if prompt else {}).get("content") or "")[:60]


def main(argv: list[str]) -> int:
    req = json.loads(argv[1])
    out = Gates(str(req["base"]).rstrip("/"), str(req["model"]), dict(req["gates"])).run()
    sys.stdout.write(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
