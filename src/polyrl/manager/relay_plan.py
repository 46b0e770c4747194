"""Who pulls a version from whom (`manager.transfer.relay_fan_out`).

The workers form a tree in the order they joined: the first `fan_out` pull from the
publisher, and worker i after them from worker i // fan_out - 1. Relays forward each
chunk once they have checked it (`transfer/relay.py`), so a version reaches the deepest
worker about one chunk per level after the first; the publisher sends it `fan_out`
times, whatever the fleet's size.

Fan-out trades link speed against depth. Every sender's link is shared by its children:
with fan-out f each pull runs at 1/f of a link, so the whole fleet holds the version in
about f single pulls plus one chunk per level. A chain (f = 1) is as fast as one pull
plus one chunk per worker; f = 2 halves the depth and doubles the time on the wire.

Each worker is given its parent, then up to `MAX_FALLBACKS` relays above it, then the
publisher: if its parent dies or stalls mid-pull, it goes on from the next, keeping the
chunks it has checked. The plan is made again for every version, so a worker that left
is simply not in the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_FALLBACKS = 2
"""Relays above the parent a receiver may go on from before the publisher."""


def relay_chains(order: Sequence[str], fan_out: int) -> dict[str, list[str]]:
    """For each worker of `order` (joined first, first), the relays it pulls from, its
    parent first; an empty list means the publisher directly (always the last source)."""
    if fan_out < 1:
        raise ValueError(f"fan_out must be >= 1, not {fan_out}")
    chains: dict[str, list[str]] = {}
    for i, worker in enumerate(order):
        chain = []
        j = i
        while j >= fan_out and len(chain) <= MAX_FALLBACKS:
            j = j // fan_out - 1
            chain.append(order[j])
        chains[worker] = chain
    return chains


def depth(num_workers: int, fan_out: int) -> int:
    """Levels of the tree of `num_workers` (1: all pull from the publisher)."""
    levels, reach, width = 0, 0, 1
    while reach < num_workers:
        width *= fan_out
        reach += width
        levels += 1
    return levels
