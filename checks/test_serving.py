"""After start (--phase serving): every rank runs the installed release (its container up, from the lock's
image and the bundle's launch files); on the head /health answers, /v1/models lists the served name, and a one-token
completion comes back. Run on the head, from the head itself (the API may listen on loopback)."""

from __future__ import annotations

from typing import Any

import pytest
from checklib import (
    LABEL_BUNDLE,
    Cmd,
    Concern,
    lane_container,
    lane_docker,
    or_skip,
    read_applied,
    remote_json,
    run,
)

from builder.hostscripts import SERVE, dumps, shown
from builder.hostscripts.lane import redact


def planned(expect: dict[str, Any]) -> list[Cmd]:
    """This rank's containers (where docker is expected)."""
    return lane_docker(expect)


CONCERN = Concern(name="serving", order=100, phase="serving", containers=True, prefetch=planned)


@pytest.fixture(scope="module")
def api(host: Any, expect: dict[str, Any]) -> dict[str, Any]:
    serve = or_skip(expect.get("serve"), expect.get("serve_reason") or "lane settings unknown")
    if expect["host"]["role"] != "head":
        pytest.skip("the API is served by the head (rank 0)")
    base = f"http://127.0.0.1:{serve['port']}"
    got: dict[str, Any] = remote_json(
        host, SERVE, dumps({"base": base, "model": serve["served_name"], "timeout": 60})
    )
    got["_base"], got["_name"] = base, serve["served_name"]
    return got


def _ok(api: dict[str, Any], name: str, path: str) -> str:
    r = api[name]
    assert r.get("status") == 200, (
        f"{api['_base']}{path}: expected HTTP 200, found {r.get('status') or r.get('error')}"
    )
    return str(r["body"])


def test_health(api: dict[str, Any]) -> None:
    _ok(api, "health", "/health")


def test_models_lists_served_name(api: dict[str, Any]) -> None:
    import json

    body = json.loads(_ok(api, "models", "/v1/models"))
    ids = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]
    assert api["_name"] in ids, f"/v1/models: expected {api['_name']!r}, found {ids}"


def test_one_token_completion(api: dict[str, Any]) -> None:
    import json

    body = json.loads(_ok(api, "completion", "/v1/completions"))
    choices = body.get("choices") or []
    assert choices, f"/v1/completions: expected a choice, found {str(body)[:120]}"


#: how many of an exited engine's last log lines its check shows
LOG_LINES = 5


def last_log_lines(host: Any, name: str) -> str:
    r = run(host, f"docker logs --tail {LOG_LINES} %s 2>&1", name)
    return redact(" | ".join(ln.strip() for ln in str(r.stdout or "").splitlines() if ln.strip()))[-600:]


def test_rank_runs_the_release(host: Any, expect: dict[str, Any], finding: Any) -> None:
    """Every rank (not only the head): its container is up, runs the lock's image, was started from
    the installed bundle, with the environment and arguments that bundle's launch files give. A rank
    whose engine exited says its exit code, when and its last log lines, and records them (``exit``)
    so the fleet's report names the rank that exited first as the cause (builder.audit.exits)."""
    launch = or_skip(expect.get("launch"), expect.get("launch_reason") or "lane settings unknown")
    img = expect.get("image")
    c, why = lane_container(host, expect)
    rank = expect["host"]["rank"]
    assert c is not None, f"rank {rank}: expected container {launch['container']} running, found {why}"
    name = str(c.get("Name", "")).lstrip("/")
    state = c.get("State") or {}
    if not state.get("Running"):
        log = last_log_lines(host, name)
        if state.get("Status") in ("exited", "dead"):  # (created, paused, restarting: not an exit)
            finding("exit", {
                "rank": rank, "container": name, "status": state.get("Status"), "exit_code": state.get("ExitCode"),
                "finished_at": state.get("FinishedAt"), "log": log})
        pytest.fail(f"{name}: expected running, found {state.get('Status')} (exit code {state.get('ExitCode')} at "
                    f"{state.get('FinishedAt')}); its last log lines: {log or '(none)'}", pytrace=False)
    if img is not None:
        got = str(c.get("Image"))
        assert got == img["image_id"], f"{name}: expected image {img['image_id'][:19]}, found {got[:19]}"
    config = c.get("Config") or {}
    rec, rec_why = read_applied(host, expect)
    want_bundle = (rec or {}).get("bundle_id")
    got_bundle = (config.get("Labels") or {}).get(LABEL_BUNDLE)
    assert rec is not None and got_bundle == want_bundle, (
        f"{name}: expected bundle {str(want_bundle)[:16] if rec else '(' + rec_why + ')'}, found {str(got_bundle)[:16]}"
    )
    env = dict(e.split("=", 1) for e in config.get("Env") or [] if "=" in e)
    bad = [f"{k}={v!r} (found {env.get(k)!r})" for k, v in launch["env"].items() if env.get(k) != v]
    assert not bad, f"{name} environment: expected {shown(bad, 2)}"
    if launch.get("entrypoint"):
        assert (config.get("Entrypoint") or []) == launch["entrypoint"], (
            f"{name} entrypoint: expected {launch['entrypoint']}, found {config.get('Entrypoint')}"
        )
    if launch["args"] or launch.get("entrypoint"):
        assert (config.get("Cmd") or []) == launch["args"], (
            f"{name} arguments: expected {launch['args']}, found {config.get('Cmd')}"
        )
