"""The proxy's counters and histograms: registered once, counted into by the part that sees the event.

:class:`Meters` registers every series of the proxy's calls in a :class:`~aglverl.metrics.Registry` (their
names and help texts are the list of what the proxy reports); each part holds the one instance and counts into
the series it names. The gate registers its two gauges (calls in flight, calls waiting) itself, since they read
its state; the token-in part registers its own counter. Nothing here awaits or fails; registering the same
names twice in one registry is the registry's error.
"""

from __future__ import annotations

from ..metrics import Counter, Histogram, Registry

__all__ = ["Meters"]


class Meters:
    """The proxy's series in ``registry`` (see the module docstring)."""

    __slots__ = (
        "added",
        "calls",
        "continuations",
        "ejections",
        "first_byte",
        "generated",
        "held",
        "http_refused",
        "no_ids",
        "regenerated",
        "registry",
        "resume_failed",
        "resume_latency",
        "resumed",
        "retries",
        "sampling",
        "unrecorded",
        "upstream",
    )

    def __init__(self, registry: Registry) -> None:
        r = self.registry = registry
        self.calls: Counter = r.counter(
            "aglverl_proxy_calls_total", "LLM calls handled by the proxy.", ["outcome"]
        )
        self.retries: Counter = r.counter(
            "aglverl_proxy_retries_total", "Upstream tries repeated after a failure."
        )
        self.ejections: Counter = r.counter(
            "aglverl_proxy_backend_ejections_total",
            "Backends taken out of rotation after failed connections.",
        )
        self.no_ids: Counter = r.counter(
            "aglverl_proxy_calls_without_token_ids_total",
            "Recorded calls (choices) the backend sent no ids for.",
        )
        self.unrecorded: Counter = r.counter(
            "aglverl_proxy_calls_unrecorded_total",
            "Attributed calls dropped because their rollout had ended.",
        )
        self.upstream: Histogram = r.histogram(
            "aglverl_proxy_upstream_seconds", "Upstream request sent to last upstream byte (seconds)."
        )
        self.first_byte: Histogram = r.histogram(
            "aglverl_proxy_first_byte_seconds", "Request arrival to first byte sent to the agent (seconds)."
        )
        self.added: Histogram = r.histogram(
            "aglverl_proxy_added_seconds",
            "Time a call spent in the proxy beyond its last upstream try (seconds).",
        )
        self.sampling: Counter = r.counter(
            "aglverl_proxy_sampling_total",
            "Recorded calls whose sampling parameters were filled in, refused or masked as off-policy.",
            ["action"],
        )
        self.generated: Counter = r.counter(
            "aglverl_proxy_generated_tokens_total", "Response token ids recorded, over every recorded call."
        )
        self.held: Counter = r.counter(
            "aglverl_proxy_held_calls_total",
            "Calls that arrived while the proxy was paused or held, and waited.",
        )
        self.resumed: Counter = r.counter(
            "aglverl_proxy_resumed_total",
            "Recorded calls whose generation a backend aborted and the proxy continued to its end.",
        )
        self.continuations: Counter = r.counter(
            "aglverl_proxy_continuations_total",
            "Token-in continuation requests sent for aborted generations.",
        )
        self.regenerated: Counter = r.counter(
            "aglverl_proxy_regenerated_total",
            "Aborted whole answers that a completion cannot continue (tool calls, n > 1, structured output), "
            "made again from the start (the agent had seen none of them).",
        )
        self.resume_failed: Counter = r.counter(
            "aglverl_proxy_resume_failures_total",
            "Aborted generations not continued: calls the proxy does not resume (unsupported), or a backend "
            "that kept aborting or refusing for pause_timeout (refused).",
            ["reason"],
        )
        self.http_refused: Counter = r.counter(
            "aglverl_proxy_http_refused_total",
            "Requests (or connections) the proxy's HTTP server refused before any handler: malformed, past a "
            "limit (head lines, line length, body, connections) or too slow to send their head, by status.",
            ["status"],
        )
        self.resume_latency: Histogram = r.histogram(
            "aglverl_proxy_resume_seconds",
            "An aborted generation free to continue (not held) to its continuation's first token (seconds).",
        )
