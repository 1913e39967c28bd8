"""In which order a lane's ranks start and stop: the one answer that start, stop, deploy and
`builder launch` ask. Every rank starts alone, once the one before it is ready by the lane's rule.

- ``workers-first``: the workers, one at a time, then the head. TensorFold's followers (seed 000's
  serve.sh, recipes.md §10.2; seed 003, §10.3) start highest rank first: ranks 3, 2 and 1, then rank 0.
- ``workers-in-rank-order``: vLLM's headless workers start in rank order, as dsv41-node-launch.sh
  walks WORKER_IPS (§10.4, §10.6): ranks 1 to N-1, then the head.
- ``head-first`` (TensorFold's Python engine, §10.3: rank 0 listens on its store port before rank 1
  joins): the head, then the workers, highest rank first.

The lane is ready once the head's ``health`` path answers on the serve port. Stopping is the same for
every lane: the head first (a new worker must never join an old head), then the workers at once.
"""

from __future__ import annotations

from builder.inputs.hosts import Fleet, Host
from builder.inputs.lanes import Lane


def start_groups(fleet: Fleet, lane: Lane) -> list[list[Host]]:
    """The hosts in start order, as groups: a group starts once the one before it is ready (today every
    group is one rank, as each recipe starts them)."""
    ranks = fleet.by_rank()
    ascending = lane.start == "workers-in-rank-order"
    head, workers = ranks[0], sorted(ranks[1:], key=lambda h: h.rank if ascending else -h.rank)
    order = [head, *workers] if lane.start == "head-first" else [*workers, head]
    return [[h] for h in order]


def start_order(fleet: Fleet, lane: Lane) -> list[Host]:
    return [h for g in start_groups(fleet, lane) for h in g]


def stop_groups(fleet: Fleet) -> list[list[Host]]:
    """The head first, then the workers."""
    ranks = fleet.by_rank()
    return [g for g in ([ranks[0]], ranks[1:]) if g]
