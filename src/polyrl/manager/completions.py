"""The trainer's question about its Atropos groups (`protocol/completions.py`), answered
for the whole fleet: from the manager's own book (completions served on its OpenAI/vLLM
routes), then, for the keys it does not hold, from every worker's (an environment that
calls a worker directly). A worker that does not answer in ASK_TIMEOUT_S, or is no
polyrl worker (a real SGLang or vLLM server: 404), leaves its keys unknown: the trainer
counts such groups (`rollout/unversioned_groups`), it does not wait on them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import httpx
from pydantic import ValidationError

from polyrl.protocol.completions import VersionRuns, VersionsQuery, VersionsReply

if TYPE_CHECKING:
    from polyrl.manager.backends import RemoteBackend
    from polyrl.manager.manager import RolloutManager
    from polyrl.manager.registry import WorkerRecord

log = logging.getLogger("polyrl.manager")

ASK_TIMEOUT_S = 5.0
"""Well under the trainer's 10 s for the whole call: a dict lookup per key on the worker."""


async def completion_versions(manager: RolloutManager, keys: list[str]) -> list[VersionRuns | None]:
    found = manager.completions.lookup(keys)
    missing = [i for i, runs in enumerate(found) if runs is None]
    workers = [w for w in manager.registry if w.state != "gone"]
    if not missing or not workers:
        return found
    query = VersionsQuery(keys=[keys[i] for i in missing])
    replies = await asyncio.gather(*(_ask(manager.remote, w, query) for w in workers))
    for reply in replies:
        for i, runs in zip(missing, reply or [], strict=False):
            if found[i] is None:
                found[i] = runs
    return found


async def _ask(remote: RemoteBackend, worker: WorkerRecord, query: VersionsQuery) -> list[VersionRuns | None] | None:
    """One worker's bookings of `query`'s keys, aligned with them; None: it cannot tell."""
    try:
        response = await remote.post_json(worker, "/v1/completions/versions", query, ASK_TIMEOUT_S)
        versions = VersionsReply.model_validate_json(response.content).versions if response.status_code == 200 else []
    except (httpx.HTTPError, httpx.InvalidURL, ValidationError) as e:
        log.info("worker %s cannot tell its completions' versions: %s", worker.worker_id, type(e).__name__)
        return None
    return versions if len(versions) == len(query.keys) else None
