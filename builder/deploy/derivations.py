"""A fleet's derivations: each host makes its rank's (builder.hostscripts.derive, from the release's
derive.py and derive.json) at once, for the ``staged`` release in a deploy (before any switch, so a
failure changes nothing) or the ``current`` one (`builder start`); ``full`` (`builder deploy --repair`)
hashes every file against its record and makes again whatever differs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from builder.deploy.fleetwork import each, explain
from builder.errors import named

if TYPE_CHECKING:
    from builder.deploy.deployment import Deployment
    from builder.deploy.fleetwork import Fleetwork
    from builder.deploy.report import DeployReport
    from builder.inputs.hosts import Host

#: the most seconds a rank's derivations may take (seed 000's rank cache: about 6 minutes on a Spark)
DERIVE_TIMEOUT = 3600.0


def make_all(w: Fleetwork, release: str, *, full: bool = False,
             made: dict[str, list[str]] | None = None) -> dict[str, str]:
    """Make every host's derivations of `release` (`full`: hashed against their records, not trusted by
    their stat); host -> why it failed (empty: all made or held). `made` collects, per host, what was
    made again because it differed from its record."""

    def one(h: Host) -> Any:
        what = "hashing every file against its record" if full else "making what its address does not hold yet"
        w.say(f"{h.name}: derivations of rank {h.rank}: {what}")
        return w.op(h).derive(release, DERIVE_TIMEOUT, full=full)

    failed: dict[str, str] = {}
    for h, out, err in each(w.hosts, one, w.limit()):
        if err is not None:
            failed[h.name] = explain(err)
        elif out is None:
            continue
        else:
            for d in out.get("derivations") or []:
                if d.get("result") == "failed":
                    failed[h.name] = f"derivation {d.get('name')}: {d.get('why')}"
                else:
                    secs = f" in {d['seconds']:g} s" if "seconds" in d else ""
                    w.say(f"{h.name}: derivation {d.get('name')}: {d.get('result')} ({d.get('files')} file(s)){secs}")
                    if made is not None and d.get("differed"):
                        made.setdefault(h.name, []).extend(str(x) for x in d["differed"])
    return failed


def derive(d: Deployment) -> DeployReport | None:
    """Every host's derivations of the staged release (a repair: hashed against their records, and made
    again where they differ); the refusal when one failed, else None."""
    failed = make_all(d.w, "staged", full=d.rehash, made=d.replaced)
    if not failed:
        return None
    lost = {n for n, why in failed.items() if "unreachable" in why}  # (a host cut off: exit 3)
    for name, why in failed.items():
        d.out(name).result, d.out(name).message = "unreachable" if name in lost else "failed", why
    return d.refuse("making the derivations failed; no host was switched: "
                    + "; ".join(named(n, why) for n, why in failed.items()), unreachable=bool(lost))
