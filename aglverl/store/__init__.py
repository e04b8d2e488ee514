"""The single source of truth: tasks, leases, attempts, results, recorded LLM calls, resources and completion
events, and the write-ahead journal a restarted daemon recovers them from. On one event loop, no locks, no
threads.

- :mod:`.tasks` — :class:`~aglverl.store.tasks.TaskStore`: queueing and claims (long-polls handed tasks
  directly), attempts, results (first finished attempt wins), failures and retries, completion events, the
  Agent Lightning server verbs, forgetting handed-over rollouts; it holds the parts below.
- :mod:`.config` — :class:`~aglverl.store.config.StoreConfig`, the store's settings as one frozen value.
- :mod:`.entry` — one rollout as the store holds it, its snapshot, and its journal records (written and replayed).
- :mod:`.leases` — the claims' lease deadlines over the store's rollouts, the clock a trainer can stop, the
  reaper's wait and the leases it finds expired; :mod:`.waiters` — agents parked in a long-poll, handed queued
  tasks oldest first.
- :mod:`.resources` — the published resources versions.
- :mod:`.meters` — the store's Prometheus series (:class:`~aglverl.store.meters.StoreMeters`, the store's
  ``meters``).
- :mod:`.takes` — taking attempts' recorded calls from their proxy shards, one take per attempt, and settling a
  failed rollout once its last attempt's are taken.
- :mod:`.records` — what the store hands out: :class:`~aglverl.store.records.LLMCall`,
  :class:`~aglverl.store.records.RolloutRecord`; :mod:`.errors` — what it refuses, with HTTP statuses;
  :mod:`.ports` — what it calls out to (its journal; proxy shards pinning attempts).
- :mod:`.journal` — the write-ahead journal (:class:`~aglverl.store.journal.Journal`).

Where to import from: code outside this package imports the names in ``__all__`` below from
:mod:`aglverl.store` (``from aglverl.store import TaskStore, LLMCall``), and any other name (``read_records``,
``StoreMeters``, the ``Journal`` protocol of :mod:`.ports`) from the module that defines it. Here ``Journal``
is the write-ahead journal of :mod:`.journal`. Modules inside the package import from the module that defines
a name, never from the package itself.
"""

from .config import StoreConfig
from .errors import (
    AlreadyFinished,
    AttemptLost,
    InvalidResult,
    NotQueued,
    StepEnded,
    StoreClosed,
    StoreError,
    UnknownAttempt,
    UnknownRollout,
)
from .journal import Journal
from .ports import AttemptPinning
from .records import TERMINAL, TRANSITIONS, AttemptChange, AttemptEvent, LLMCall, RolloutRecord, RolloutState
from .tasks import TaskStore

__all__ = [
    "TERMINAL",
    "TRANSITIONS",
    "AlreadyFinished",
    "AttemptChange",
    "AttemptEvent",
    "AttemptLost",
    "AttemptPinning",
    "InvalidResult",
    "Journal",
    "LLMCall",
    "NotQueued",
    "RolloutRecord",
    "RolloutState",
    "StepEnded",
    "StoreClosed",
    "StoreConfig",
    "StoreError",
    "TaskStore",
    "UnknownAttempt",
    "UnknownRollout",
]
