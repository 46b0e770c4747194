"""Names that several roles must spell the same way."""

from __future__ import annotations

LOCAL_WORKER_ID = "local"
"""The trainer's own engine as a worker: the manager reserves this id for it (a remote
worker may not register under it), the trainer starts it under it, and the stats and
the hybrid window tell its samples from the fleet's by it."""
