"""The single source of truth: tasks, leases, attempts, results, recorded LLM calls, resources and completion
events (:mod:`.tasks`: :class:`~aglverl.store.tasks.TaskStore`, on one event loop, no locks, no threads),
and the write-ahead journal a restarted daemon recovers them from (:mod:`.journal`).
"""
