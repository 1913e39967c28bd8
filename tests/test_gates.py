"""The serving gates' judging (builder/hostscripts/gates.py) and the replay record's comparison
(builder/store/servingrecord.py), on their own; the gates asked of engines are in tests/test_sim_engine.py
(the simulator), tests/test_seed_fleet.py (the seed lanes on the simulator fleet) and
tests/test_vllm_serving.py (a real vLLM)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from builder.errors import ConfigError
from builder.hostscripts.gates import garbled, leaked, token_sha
from builder.inputs.lanes import Gates
from builder.store import servingrecord as sr


def test_token_sha_is_the_recipes_first_12_hex_over_the_comma_joined_ids() -> None:
    assert token_sha([1, 22, 333], "ignored") == hashlib.sha256(b"1,22,333").hexdigest()[:12]
    assert token_sha(None, "ok") == hashlib.sha256(b"ok").hexdigest()[:12]


@pytest.mark.parametrize(("text", "ids", "why"), [
    ("", [7, 7, 7, 7, 7, 7, 7, 7], "one token repeated (8 x id 7)"),
    ("!!!!!!!!!!!!", None, "one token repeated (12 x '!')"),
    ("the the the the the ", None, "one token repeated (5 x 'the')"),
    ("abc\ufffddef", None, "not valid text (U+FFFD in the reply)"),
    ("ok\x00", None, "not valid text (control characters in the reply)"),
])
def test_a_garbled_reply_says_why(text: str, ids: list[int] | None, why: str) -> None:
    assert garbled(text, ids) == why


@pytest.mark.parametrize(("text", "ids"), [
    ("323", [18, 17, 18]), ("ok", None), ("OK", [9, 9]), ("1 2 3 4 5 6 7 8 9 10", list(range(10))),
    ("It is sunny in Paris, 21 C.\n", None), ("aaa", None),
])
def test_a_reply_that_reads_as_text_is_not_garbled(text: str, ids: list[int] | None) -> None:
    assert garbled(text, ids) == ""


def test_template_markup_in_a_reply_is_named() -> None:
    assert leaked('<tool_call>\n{"name": "get_weather"}') == "<tool_call>"
    assert leaked("<｜DSML｜function_calls>") == "<｜DSML｜"
    assert leaked("It is sunny.") == ""


def _rec(prompt: str, ids: list[int], text: str) -> dict[str, object]:
    return {"prompt": prompt, "ids": ids, "token_sha": token_sha(ids, text), "text": text}


def test_a_replay_difference_names_the_prompt_the_position_and_the_tokens() -> None:
    base = [_rec("17*19=", [5, 6, 7], "323"), _rec("Name a colour.", [40, 41, 2], "blue")]
    same = [_rec("17*19=", [5, 6, 7], "323"), _rec("Name a colour.", [40, 41, 2], "blue")]
    assert sr.replay_differences(base, same) == []
    moved = [_rec("17*19=", [5, 6, 7], "323"), _rec("Name a colour.", [40, 52, 2], "green")]
    assert sr.replay_differences(base, moved) == [
        "'Name a colour.': first difference at token 1: id 41 -> 52 ('blue' -> 'green')"]
    shorter = [_rec("17*19=", [5, 6], "32")]
    assert sr.replay_differences(base, shorter) == [
        "'17*19=': first difference at token 2: id 7 -> end ('323' -> '32')"]
    # a prompt the baseline never asked has nothing to compare with; one with no answer is a difference
    assert sr.replay_differences(base, [_rec("new prompt", [1], "x")]) == []
    failed = [{"prompt": "17*19=", "ids": None, "token_sha": None, "text": "", "error": "HTTP 500: boom"}]
    assert sr.replay_differences(base, failed) == ["'17*19=': no answer (HTTP 500: boom)"]


def test_serving_records_are_kept_per_fleet_and_bundle_and_a_damaged_one_is_an_error(tmp_path: Path) -> None:
    facts = {"gates": {"chat_probe": True}, "replay": [_rec("17*19=", [5], "323")], "speed": {"tok_s": 12.5}}
    rec = sr.make("f1", "b" * 64, "c" * 64, facts, "2026-12-06T00:00:00Z")
    p = sr.save(tmp_path, rec)
    assert p == tmp_path / "deploy" / "serving" / "f1" / f"{'b' * 64}.json"
    assert sr.load(tmp_path, "f1", "b" * 64) == rec
    assert sr.records(tmp_path, "f1") == {"b" * 64: rec}
    assert sr.load(tmp_path, "f1", "a" * 64) is None and sr.records(tmp_path, "other") == {}
    p.write_text("{not json")
    with pytest.raises(ConfigError, match=r"damaged serving record .* remove it and run `builder start`"):
        sr.load(tmp_path, "f1", "b" * 64)


def test_a_fleet_keeps_its_newest_records(tmp_path: Path) -> None:
    for i in range(sr.KEEP + 3):
        sr.save(tmp_path, sr.make("f", f"{i:064x}", None, {"replay": []}, "t"))
    kept = sorted(sr.records(tmp_path, "f"))
    assert len(kept) == sr.KEEP and f"{sr.KEEP + 2:064x}" in kept and f"{0:064x}" not in kept


def test_the_gates_a_lane_names_nothing_of_are_the_recipes_defaults() -> None:
    g = Gates()
    assert g.chat_probe is not None and (g.chat_probe.prompt, g.chat_probe.expect) == ("17*19=", "323")
    assert (g.burst, g.concurrent, g.streamed, g.token_ids) == (4, 8, True, True)
    assert g.tools is None and g.speed is None and not g.reasoning and not g.draft_switch
    assert g.replay[0] == "17*19=" and len(g.replay) == 5
