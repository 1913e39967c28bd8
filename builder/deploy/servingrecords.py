"""After a serving audit passes: the head's answers (its gates, its replay and its speed) become the
release's serving record (builder.store.servingrecord), in the operator's store, keyed by the head's
bundle id; the baseline the next deploy's replay is compared with."""

from __future__ import annotations

import datetime as dt
from typing import Any

from builder.deploy.fleetwork import Fleetwork
from builder.errors import BuilderError
from builder.store import servingrecord


def head_facts(report: dict[str, Any], head: str) -> dict[str, Any]:
    """The gates check's facts on the head (``gates``, ``replay``, ``speed``), from an audit's JSON."""
    checks = ((report.get("hosts") or {}).get(head) or {}).get("checks") or {}
    facts: dict[str, Any] = {}
    for c in checks.values():
        for k in ("gates", "replay", "speed", "replay_accepted"):
            if k in (c.get("facts") or {}):
                facts[k] = c["facts"][k]
    return facts


def keep(w: Fleetwork, report: dict[str, Any], bundle: str | None) -> dict[str, Any] | None:
    """Write the serving record of `bundle` (the head's) from a passed serving audit; None when the lane
    declares no gates or the head's answers were not asked."""
    facts = head_facts(report, w.head.name)
    if bundle is None or "replay" not in facts:
        return None
    at = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    rec = servingrecord.make(w.fleet_name, bundle, w.ctx.lock.lock_hash(), facts, at,
                             accepted=bool(facts.get("replay_accepted")))
    servingrecord.save(w.opts.store, rec)
    try:
        w.op(w.head).keep_serving(bundle, rec)
    except BuilderError as e:  # (the operator's copy is the baseline; the host's is for whoever looks there)
        w.say(f"{w.head.name}: the serving record was not kept on the host: {e}")
    tok = (rec.get("speed") or {}).get("tok_s")
    passed = sum(1 for ok in rec["gates"].values() if ok)
    w.say(f"fleet {w.fleet_name}: serving record of {bundle[:12]}: gates {passed}/{len(rec['gates'])}, "
          f"replay of {len(rec['replay'])} prompts{', accepted as the new baseline' if rec['accepted'] else ''}"
          f"{f', {tok} tok/s' if tok is not None else ''}")
    return rec
