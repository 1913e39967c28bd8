"""A deploy's first change: stage the new release on every host (``current`` is not touched), and the
gate: the preflight audit of what was staged, before any host is switched."""

from __future__ import annotations

from typing import TYPE_CHECKING

from builder.deploy.deployment import Deployment
from builder.deploy.fleetaudit import audit, problems
from builder.deploy.fleetwork import each, explain, short
from builder.deploy.report import DeployReport
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
                w.say(named(h.name, f"{e}; shipping the bundle instead"))

        r = ship(
            w.opts.root,
            f"{w.fleet_name}/{h.name}",
            ShipOptions(
                bundle=d.bundles[h.name].path, hosts_dir=w.opts.hosts_dir, signing_key=w.opts.key,
                allow_outside_key=w.opts.allow_outside_key, timeout=w.opts.timeout,
                connect_timeout=w.opts.connect_timeout, insecure=w.opts.insecure,
                stage=True, rehash=d.rehash, sockets=w.shared,
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
            w.say(named(h.name, o.message, "staging failed"))
        else:
            o.result, o.message = "staged", msg
            w.say(f"{h.name}: {msg}: bundle {short(d.bundles[h.name].bundle_id)}")
    return ok


def gate(d: Deployment) -> DeployReport | None:
    """The gate: the preflight audit of the staged release on every host, recorded in the report; the
    refusal (no host switched, each that did not pass named) when it fails, else None."""
    report = audit(d.w, "preflight", release="staged")
    d.rep.audit = report.to_json()
    if report.exit_code == 0:
        return None
    for hr in report.hosts:
        if hr.status != "pass":
            d.out(hr.name).message = hr.first_problem() or hr.status
            d.out(hr.name).result = "unreachable" if hr.status == "unreachable" else "not-switched"
    return d.refuse(f"the preflight audit failed, no host was switched: {problems(report)}",
                    unreachable=report.exit_code == 3)
