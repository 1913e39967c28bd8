"""After start (--phase serving), on the head: what the release answers. The lane's serving gates (the
recipes' §15: the chat probe, the reasoning stream, the tool call plain and streamed and its second
turn, drafted == serial, a burst, concurrent == solo, streamed == non-streamed, and the garble gate
over every reply), the replay of the lane's prompts at T=0 against the release's baseline record
(builder.store.servingrecord), and the speed band. One remote call asks them all
(builder.hostscripts.gates); each gate is its own check, so the report names the gate, the prompt
and what came back."""

from __future__ import annotations

from typing import Any

import pytest
from checklib import Cmd, Concern, or_skip, read_applied, remote_json

from builder.hostscripts import GATES, dumps
from builder.store.servingrecord import replay_differences


def planned(expect: dict[str, Any]) -> list[Cmd]:
    """Nothing to fetch ahead: the one remote call is the gates' own, made when the first check needs it."""
    return []


CONCERN = Concern(name="gates", order=110, phase="serving", prefetch=planned)


@pytest.fixture(scope="module")
def asked(host: Any, expect: dict[str, Any]) -> dict[str, Any]:
    if expect["host"]["role"] != "head":
        pytest.skip("the API is served by the head (rank 0)")
    serve = or_skip(expect.get("serve"), expect.get("serve_reason") or "lane settings unknown")
    g = or_skip(expect.get("gates"), "the lane declares no gates")
    req = {"base": f"http://127.0.0.1:{serve['port']}", "model": serve["served_name"], "gates": g["declared"]}
    got: dict[str, Any] = remote_json(host, GATES, dumps(req))
    return got


def _gate(asked: dict[str, Any], gate: str, finding: Any) -> None:
    r = asked["gates"].get(gate)
    if r is None:
        pytest.skip(f"the lane does not declare the {gate} gate")
    finding("gate", r)
    assert r["ok"], f"gate {gate}: {r['why']} (asked {r['prompt']!r}; got {r['got'][:160]!r})"


# (one check each, so the report names the gate: the check id is the function's name)
def test_models(asked: dict[str, Any], finding: Any) -> None:
    _gate(asked, "models", finding)


def test_chat_probe(asked: dict[str, Any], finding: Any) -> None:
    _gate(asked, "chat_probe", finding)


def test_reasoning_stream(asked: dict[str, Any], finding: Any) -> None:
    _gate(asked, "reasoning_stream", finding)


def test_tool_call(asked: dict[str, Any], finding: Any) -> None:
    _gate(asked, "tool_call", finding)


def test_tool_call_stream(asked: dict[str, Any], finding: Any) -> None:
    _gate(asked, "tool_call_stream", finding)


def test_tool_result(asked: dict[str, Any], finding: Any) -> None:
    _gate(asked, "tool_result", finding)


def test_drafted_equals_serial(asked: dict[str, Any], finding: Any) -> None:
    _gate(asked, "drafted_equals_serial", finding)


def test_burst(asked: dict[str, Any], finding: Any) -> None:
    _gate(asked, "burst", finding)


def test_concurrent_equals_solo(asked: dict[str, Any], finding: Any) -> None:
    _gate(asked, "concurrent_equals_solo", finding)


def test_streamed_equals_plain(asked: dict[str, Any], finding: Any) -> None:
    _gate(asked, "streamed_equals_plain", finding)


def test_garble(asked: dict[str, Any], finding: Any) -> None:
    _gate(asked, "garble", finding)


def test_replay(asked: dict[str, Any], host: Any, expect: dict[str, Any], finding: Any) -> None:
    """The lane's prompts answer token for token as the baseline release's record says (a deploy: the
    release that ran before; otherwise the release's own record, so a restart answers as it did)."""
    g = expect["gates"]
    finding("replay", asked["replay"])
    finding("gates", {k: v["ok"] for k, v in asked["gates"].items()})
    failed = [r for r in asked["replay"] if r.get("error")]
    assert not failed, f"replay {failed[0]['prompt']!r}: no answer ({failed[0]['error']})"
    base = baseline(host, expect)
    if not base:
        pytest.skip("no release to compare with")
    was = g["records"].get(base)
    if was is None:
        pytest.skip(f"release {base[:12]} has no replay record yet: these answers become its record")
    diffs = replay_differences(was["replay"], asked["replay"])
    if diffs and g["accept_replay"]:
        finding("replay_accepted", diffs)
        return
    changes = g["lock_changes"].get(base) or []
    lock = ("; what changed in the lock since: " + "; ".join(changes[:4])) if changes else (
        "; the lock is the same: the engine did not answer as it did (restart or concurrency broke determinism)")
    assert not diffs, (f"replay against release {base[:12]}: {len(diffs)} of {len(asked['replay'])} prompts "
                       f"changed: {'; '.join(diffs[:3])}{lock} (accept with --accept-replay)")


def baseline(host: Any, expect: dict[str, Any]) -> str | None:
    """The bundle whose record the answers are compared with: the deploy's release before, else the
    release the head runs."""
    base: str | None = expect["gates"]["baseline"]
    if base is None:
        rec, _ = read_applied(host, expect)
        base = (rec or {}).get("bundle_id")
    return base


def test_speed(asked: dict[str, Any], host: Any, expect: dict[str, Any], finding: Any) -> None:
    """The fixed decode check's tok/s against the lane's floor and the baseline release's figure."""
    s = asked.get("speed")
    want = expect["gates"]["declared"].get("speed")
    if not want or s is None:
        pytest.skip("the lane declares no speed check")
    assert s.get("tok_s") is not None, f"speed {want['prompt']!r}: no answer ({s.get('error')})"
    if want.get("floor") is not None:
        assert s["tok_s"] >= want["floor"], (
            f"speed: {s['tok_s']} tok/s, below the lane's floor of {want['floor']} tok/s")
    finding("speed", s)
    was = (expect["gates"]["records"].get(baseline(host, expect) or "") or {}).get("speed") or {}
    if was.get("tok_s") and want.get("tolerance") is not None:
        low = was["tok_s"] * (1 - want["tolerance"])
        assert s["tok_s"] >= low, (
            f"speed: {s['tok_s']} tok/s, down from {was['tok_s']} tok/s of the release before "
            f"(more than the lane's tolerance of {want['tolerance']:.0%})")
