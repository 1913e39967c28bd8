"""The labels start.sh gives each rank's container, and docker's filter that selects a lane's containers
by them: the rendering (builder.launch), deploy's host state and the audit's checks read the same names
here, so nothing else on a host is looked at or stopped (start.sh and stop.sh spell the same filter in
shell, from these names)."""

from __future__ import annotations

LABEL_LANE = "io.builder.lane"
LABEL_RANK = "io.builder.rank"
LABEL_BUNDLE = "io.builder.bundle-id"
LABEL_FLEET = "io.builder.fleet"
LABEL_HOST = "io.builder.host"


def lane_filters(lane: str, rank: int | None = None) -> list[str]:
    """docker's ``--filter`` arguments (``docker ps``) that select the containers start.sh made for this
    lane, and of this rank when given."""
    out = ["--filter", f"label={LABEL_LANE}={lane}"]
    if rank is not None:
        out += ["--filter", f"label={LABEL_RANK}={rank}"]
    return out
