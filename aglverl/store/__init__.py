"""The single source of truth: tasks, leases, attempts, results, recorded LLM calls, resources and completion
events, and the write-ahead journal a restarted daemon recovers them from. On one event loop, no locks, no
threads.

- :mod:`.tasks` — :class:`~aglverl.store.tasks.TaskStore`: queueing and claims (long-polls handed tasks
  directly), attempts, results (first finished attempt wins), failures and retries, completion events, the
  Agent Lightning server verbs, forgetting handed-over rollouts; it holds the parts below.
- :mod:`.config` — :class:`~aglverl.store.config.StoreConfig`, the store's settings as one frozen value.
- :mod:`.entry` — one rollout as the store holds it, its snapshot, and its journal records (written and replayed).
- :mod:`.leases` — the lease deadlines, the clock a trainer can stop, the reaper's wait; :mod:`.waiters` — agents
  parked in a long-poll, handed queued tasks oldest first.
- :mod:`.resources` — the published resources versions.
- :mod:`.records` — what the store hands out: :class:`~aglverl.store.records.LLMCall`,
  :class:`~aglverl.store.records.RolloutRecord`; :mod:`.errors` — what it refuses, with HTTP statuses;
  :mod:`.ports` — what it calls out to (its journal; proxy shards pinning attempts).
- :mod:`.journal` — the write-ahead journal (:class:`~aglverl.store.journal.Journal`).

The names callers have always imported from :mod:`.tasks` (``LLMCall``, ``RolloutRecord``, the errors, the
ports) are re-exported there.
"""
