"""A deploy's first change: stage the new release on every host (``current`` is not touched)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from builder.deploy.deployment import Deployment
from builder.deploy.fleetwork import each, explain, short
from builder.errors import BuilderError, UnreachableError, named
from builder.ship import ShipOptions, ship

if TYPE_CHECKING:
    from builder.inputs.hosts import Host


def stage(d: Deployment) -> bool:
    """Stage every host's new release (the one there already, else ship the bundle with install --stage),
    at most `parallel` at once; False when any host failed (each named in the report)."""
    w = d.w

    def one(h: Host) -> str:
        bid, st = d.bundles[h.name].bundle_id, w.states[h.name]
        if bid in st.releases and not d.rehash:  # (a repair: from the verified bundle, every file hashed)
            try:
                w.op(h).stage_installed(bid)
                return "staged (the release was on the host)"
            except UnreachableError:
                raise
            except BuilderError as e:
                d.say(named(h.name, f"{e}; shipping the bundle instead"))

        r = ship(
            d.opts.root,
            f"{w.fleet_name}/{h.name}",
            ShipOptions(
                bundle=d.bundles[h.name].path, signing_key=d.opts.key, timeout=d.opts.timeout,
                connect_timeout=d.opts.connect_timeout, insecure=d.opts.insecure, stage=True,
                rehash=d.rehash, sockets=w.shared,
            ),
        )
        if d.rehash and (r.differed or r.sent):
            d.replaced[h.name] = list(r.differed or r.sent)
        return f"staged ({len(r.sent)} files sent, {len(r.skipped)} already there)"

    ok = True
    for h, msg, err in each(w.hosts, one, w.limit()):
        o = d.out(h)
        if err is not None:
            ok = False
            o.result = "unreachable" if isinstance(err, UnreachableError) else "failed"
            o.message = explain(err)
            d.rep.unreachable = d.rep.unreachable or isinstance(err, UnreachableError)
            d.say(named(h.name, o.message, "staging failed"))
        else:
            o.result, o.message = "staged", msg
            d.say(f"{h.name}: {msg}: bundle {short(d.bundles[h.name].bundle_id)}")
    return ok

