"""In which order a lane's ranks start and stop: the one answer that start, stop, deploy and
`builder launch` ask.

- ``workers-first`` (TensorFold's followers and vLLM's headless workers dial the head and retry):
  the workers, each until it is ready, then the head;
- ``head-first`` (TensorFold's Python engine: rank 0 listens on its store port before rank 1 joins):
  the head until it is ready, then the workers.

The lane is ready once the head's ``health`` path answers on the serve port. Stopping is the same for
every lane: the head first (a new worker must never join an old head), then the workers.
"""

from __future__ import annotations

from builder.hosts import Fleet, Host
from builder.lanes import Lane


def start_groups(fleet: Fleet, lane: Lane) -> list[list[Host]]:
    """The hosts in start order, as groups: every host of a group starts at once, a group once the one
    before it is ready. Workers are listed highest rank first (the recipes start ranks 3, 2, 1, then 0)."""
    ranks = fleet.by_rank()
    head, workers = ranks[0], sorted(ranks[1:], key=lambda h: -h.rank)
    groups = [workers, [head]] if lane.start == "workers-first" else [[head], workers]
    return [g for g in groups if g]


def start_order(fleet: Fleet, lane: Lane) -> list[Host]:
    return [h for g in start_groups(fleet, lane) for h in g]


def stop_groups(fleet: Fleet) -> list[list[Host]]:
    """The head first, then the workers."""
    ranks = fleet.by_rank()
    return [g for g in ([ranks[0]], ranks[1:]) if g]
