"""The ``aglverl:`` section of a run's config: :class:`DaemonOptions`, checked at construction."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from .._net import refuse_open_address
from ..proxy.config import PROXY_FIELDS, ProxyConfig, RetryPolicy, with_aliases
from ..proxy.overload import OverloadPolicy
from ..proxy.shards import check_shard_count
from ..runners.options import ProcessOptions
from ..trajectory.signals import SignalConfig
from .validation import ConfigError, check_fields, unknown_key_message

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DaemonOptions:
    """The ``aglverl:`` section: how the daemon (task server + LLM proxy) is run.

    - ``host``/``port``: where agents connect (loopback and ephemeral ports by default; the URLs are logged);
      ``token``: bearer token agents must send. Both hold for the LLM proxy too, unless its section says.
    - ``proxy``: the LLM proxy's settings (:class:`~aglverl.proxy.config.ProxyConfig`), as a mapping of its
      fields read whole: ``port``, ``pause_timeout``, ``hold_timeout``, ``max_body_bytes``, ``retry`` and
      ``overload`` (mappings of :class:`~aglverl.proxy.config.RetryPolicy`'s and
      :class:`~aglverl.proxy.overload.OverloadPolicy`'s fields), ``sampling_mismatch``, ``token_in``, ... (see
      :class:`~aglverl.proxy.LLMProxy`). What a training run changes from the proxy's own defaults:
      ``hold_timeout`` is 4 hours, so that hour-long steps fit: how long an agent's LLM call may wait while the
      trainer holds the proxy for its update (old/ref log-probs, actor and critic updates, checkpoint save,
      weight sync); leases do not run meanwhile, so no agent loses its task for time spent in a held call.
      ``sampling_mismatch``: a call that sets other sampling parameters than the trainer's (temperature,
      top_p, top_k; others at non-neutral values) is refused with a 400 naming them (``"refuse"``) or kept
      out of the loss (``"mask"``); parameters a call omits are filled in with the trainer's either way.
      ``token_in`` (default on): a chat call whose messages extend an earlier call's messages + answer is
      generated from that call's exact ids, so a conversation an agent re-sends as text trains as one row
      (``aglverl.proxy.tokenin``); ``false`` relays every call as text. ``overload.refuse``: whether the proxy
      turns first calls away (429) while its event loop is late; left unset, it does unless the run's agents
      are in-process ``agent=`` functions (see :mod:`aglverl.proxy.overload`). The old flat keys are aliases:
      ``aglverl.proxy_port``, ``aglverl.hold_timeout``, ``aglverl.sampling_mismatch`` and ``aglverl.token_in``
      are ``aglverl.proxy.port``, ``.hold_timeout``, ``.sampling_mismatch`` and ``.token_in``.
    - ``lease_seconds``/``max_attempts``/``step_timeout``: claim lease, claims per rollout, and the bound on
      one training step's rollouts (``None``: leases and attempts alone bound it).
    - ``journal``: the daemon's write-ahead journal: a path, ``"auto"`` (``<trainer.default_local_dir>/
      aglverl.journal`` when checkpoints are saved, so a resumed run recovers the step in flight) or ``None``.
    - ``llm_resource``: ``"proxy"`` (per-rollout URLs, token ids recorded) or ``"plain"`` (Agent Lightning 0.1
      clients, which post their own triplets).
    - ``agents``: with ``AsyncVERL(agent=...)``, how many agent loops to run (default: every rollout of a step at
      once, ``train_batch_size * rollout.n``); with ``processes``, how many agent processes at once (default: a
      step's rollouts, at most 4 per core and one per 256 MiB of available memory, or 16 per core and one per
      64 MiB for Python agents the fork server forks: :func:`aglverl.runners.default_concurrency`); ``0``: none
      (agents connect from elsewhere, e.g. Agent Lightning's controller).
    - ``processes``: agents run as one process per rollout attempt by aglverl
      (:class:`~aglverl.runners.ProcessOptions`: an Agent Lightning v1.0 ``agent_class`` or any ``command``,
      ``env_map``, ``timeout_seconds``, ``reward_fillna_value``, ``log_dir``, ``python``, ``fork_server``,
      ``cwd``, ``env_allow``, ``limits``, ``kill_grace_seconds``, ``log_max_bytes``), as a mapping of its fields;
      Agent Lightning's ``agentlightning:`` section maps onto it.
    - ``accept_outside_rollouts``: whether ``POST /api/rollouts`` on the run's task server queues rollouts for
      the run's agents (default ``false``: a 403, as ``POST /tasks``).
    - ``allow_unauthenticated``: serve on a ``host`` that is not a loopback address without a ``token``
      (default ``false``: refused at construction).
    - ``platform``: ``"auto"`` (CPU when no GPU is visible), ``"cpu"`` or ``"gpu"``.
    - ``signal``: the training-signal controls (:class:`~aglverl.trajectory.signals.SignalConfig`: rejection sampling,
      compact filtering, step-wise advantage, behaviour log-probs), as a mapping of its fields.
    - ``max_failed_groups``: a training group whose every rollout failed is replaced by a fresh prompt (verl's
      refill, in every mode); after this many such groups in a row the run stops with
      :class:`~aglverl.trajectory.groups.AgentsFailing`, naming the agents' most frequent errors. ``None`` (default):
      ``data.train_batch_size``, a whole batch's worth; ``0``: never stop.
    - ``proxy_shards``: ``1`` (default) runs the LLM proxy in the daemon's process; ``N`` or ``"per_node"``
      runs it as that many Ray actors beside verl's rollout replicas (``"per_node"``: one per node hosting
      replicas), every rollout attempt pinned to one (:mod:`aglverl.proxy.shards`); ``proxy.port`` then does not apply.
    - ``tool_call_parser``: the tool-call parser verl's vLLM rollout (``rollout.name: vllm``) is started with,
      so that it answers ``tools`` (``--enable-auto-tool-choice --tool-call-parser NAME``, set in
      ``rollout.engine_kwargs.vllm`` unless given there): ``"auto"`` (default) picks it from the model's family
      (:func:`aglverl.algorithm.vllm_tools.pick_tool_call_parser`: ``hermes`` for Qwen2.5 / Qwen3 and Hermes templates,
      ``llama3_json`` for Llama 3.x, ``mistral`` for Mistral, ...), a name forces one of vLLM's parsers, ``None``
      starts vLLM without tool calling. The embedded engine reads its model's chat template instead.
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    proxy: ProxyConfig = dataclasses.field(default_factory=lambda: ProxyConfig(hold_timeout=RUN_HOLD_TIMEOUT))
    lease_seconds: float = 600.0
    max_attempts: int = 3
    step_timeout: float | None = None
    journal: str | None = "auto"
    llm_resource: Literal["proxy", "plain"] = "proxy"
    agents: int | None = None
    platform: Literal["auto", "cpu", "gpu"] = "auto"
    signal: SignalConfig = dataclasses.field(default_factory=SignalConfig)
    max_failed_groups: int | None = None
    proxy_shards: int | Literal["per_node"] = 1
    tool_call_parser: str | None = "auto"
    processes: ProcessOptions = dataclasses.field(default_factory=ProcessOptions)
    accept_outside_rollouts: bool = False
    allow_unauthenticated: bool = False

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> DaemonOptions:
        """Build from the ``aglverl:`` mapping; an unknown key, a value of the wrong type or out of range raises
        :class:`ConfigError` naming the key, the value and what is allowed."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"the aglverl section must be a mapping of its options, got {values!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in names and key not in PROXY_ALIASES:
                raise ConfigError(unknown_key_message(f"aglverl.{key}", key, names | PROXY_ALIASES.keys()))
        values = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in values.items()}
        values["proxy"] = _proxy_section(values)
        check_fields(
            cls, {k: v for k, v in values.items() if k not in _SUBSECTIONS and k != "proxy"}, "aglverl"
        )
        for key, (name, read) in _SUBSECTIONS.items():
            value = values.get(key)
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"aglverl.{key} must be a mapping of {name}'s fields, got {value!r}")
            try:
                values[key] = read(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"aglverl.{key}: {exc}") from exc
        options = cls(**values)
        _check_ranges(vars(options), _OPTION_RANGES, {}, _NULLABLE_OPTIONS)
        try:
            check_shard_count(options.proxy_shards, "aglverl.proxy_shards")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _check_tool_call_parser(options.tool_call_parser)
        try:
            refuse_open_address(
                options.host,
                options.token,
                allow_unauthenticated=options.allow_unauthenticated,
                keys="aglverl.allow_unauthenticated: true",
            )
        except ValueError as exc:
            raise ConfigError(f"aglverl.host: {exc}") from None
        return options

    # The flat keys the ``proxy`` section replaced, read as they were (``options.token_in``...).
    @property
    def proxy_port(self) -> int:
        return self.proxy.port

    @property
    def hold_timeout(self) -> float:
        return self.proxy.hold_timeout

    @property
    def sampling_mismatch(self) -> Literal["refuse", "mask"]:
        return self.proxy.sampling_mismatch

    @property
    def token_in(self) -> bool:
        return self.proxy.token_in


#: The ``aglverl:`` keys that are the old names of ``aglverl.proxy:`` settings (aliases, still read).
PROXY_ALIASES: Mapping[str, str] = {
    "proxy_port": "port",
    "hold_timeout": "hold_timeout",
    "sampling_mismatch": "sampling_mismatch",
    "token_in": "token_in",
}
#: A training run's ``hold_timeout`` unless set: hour-long steps fit.
RUN_HOLD_TIMEOUT = 4 * 3600.0
#: Bounds of the proxy's settings that have one: (field, low, high, ">" or ">=").
_PROXY_RANGES: tuple[tuple[str, float, float | None, str], ...] = (
    ("port", 0, 65535, ">="),
    ("request_timeout", 0, None, ">"),
    ("connect_timeout", 0, None, ">"),
    ("max_body_bytes", 1, None, ">="),
    ("max_response_bytes", 1, None, ">="),
    ("eject_seconds", 0, None, ">="),
    ("pause_timeout", 0, None, ">"),
    ("hold_timeout", 0, None, ">"),
    ("shutdown_grace", 0, None, ">="),
    ("upstream_keepalive", 0, None, ">="),
)


def _proxy_section(values: dict[str, Any]) -> ProxyConfig:
    """The ``aglverl.proxy:`` section read whole into the proxy's config, with the old flat keys (aliases)
    taken out of ``values``, ``aglverl.host`` / ``aglverl.token`` as its own unless it names them, and a run's
    defaults; :class:`ConfigError` naming the key as the user wrote it."""
    section = values.pop("proxy", None)
    if section is not None and not isinstance(section, Mapping):
        raise ConfigError(
            f"aglverl.proxy must be a mapping of the proxy's settings (ProxyConfig's fields), got {section!r}"
        )
    section = with_aliases(section or {})
    written = {name: f"aglverl.proxy.{name}" for name in section}
    for old, name in PROXY_ALIASES.items():
        if old in values:
            if name in section:
                raise ConfigError(f"aglverl.{old} is the old name of aglverl.proxy.{name}: set one of them")
            section[name], written[name] = values.pop(old), f"aglverl.{old}"
    for name in section:
        if name not in PROXY_FIELDS:
            raise ConfigError(unknown_key_message(f"aglverl.proxy.{name}", name, PROXY_FIELDS))
    for name, shown in written.items():
        try:
            check_fields(ProxyConfig, {name: section[name]}, "aglverl.proxy")
        except ConfigError as exc:
            raise ConfigError(str(exc).replace(f"aglverl.proxy.{name}", shown, 1)) from None
    for name, policy in (("retry", RetryPolicy), ("overload", OverloadPolicy)):
        if isinstance(section.get(name), Mapping):
            check_fields(policy, section[name], f"aglverl.proxy.{name}")
    _check_ranges(section, _PROXY_RANGES, written, frozenset())
    defaults = {
        "hold_timeout": RUN_HOLD_TIMEOUT,
        "host": values.get("host", "127.0.0.1"),
        "token": values.get("token"),
    }
    try:
        return ProxyConfig.from_mapping(section, **defaults)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"aglverl.proxy: {exc}") from exc


def _check_tool_call_parser(value: str | None) -> None:
    """``aglverl.tool_call_parser`` must be ``"auto"``, ``None`` or a tool parser the installed vLLM has (vLLM
    0.32's list where vLLM is not installed)."""
    from .vllm_tools import known_tool_parsers

    if value is None or value == "auto":
        return
    allowed = known_tool_parsers()
    if value not in allowed:
        close = difflib.get_close_matches(value, allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"aglverl.tool_call_parser: {value!r} is not 'auto', null or one of vLLM's tool parsers "
            f"({', '.join(allowed)}){hint} (a plugin's parser: set actor_rollout_ref.rollout.engine_kwargs.vllm."
            "tool_call_parser and tool_parser_plugin instead)"
        )


def _check_ranges(
    values: Mapping[str, Any],
    ranges: Sequence[tuple[str, float, float | None, str]],
    shown: Mapping[str, str],
    nullable: frozenset[str],
) -> None:
    """:class:`ConfigError` for a value of ``values`` out of its range (``(key, low, high, ">" or ">=")``),
    named as ``shown`` writes it (``aglverl.<key>`` otherwise); ``None`` and absent values pass."""
    for key, low, high, bound in ranges:
        value = values.get(key)
        if value is None or isinstance(value, bool):
            continue
        fits = (value > low if bound == ">" else value >= low) and (high is None or value <= high)
        if not fits:  # NaN fits no bound
            allowed = f"{bound} {low:g}" + (f" and <= {high:g}" if high is not None else "")
            null = " (or null)" if key in nullable else ""
            raise ConfigError(f"{shown.get(key, f'aglverl.{key}')} must be {allowed}{null}, got {value!r}")


#: The ``aglverl:`` options that are sections of their own: their class's name and reader.
_SUBSECTIONS: dict[str, tuple[str, Any]] = {
    "signal": ("SignalConfig", SignalConfig.from_dict),
    "processes": ("ProcessOptions", ProcessOptions.from_mapping),
}

#: Bounds of the ``aglverl:`` options: (field, low, high, ">" or ">=").
_OPTION_RANGES: tuple[tuple[str, float, float | None, str], ...] = (
    ("port", 0, 65535, ">="),
    ("lease_seconds", 0, None, ">"),
    ("max_attempts", 1, None, ">="),
    ("step_timeout", 0, None, ">"),
    ("agents", 0, None, ">="),
    ("max_failed_groups", 0, None, ">="),
)
_NULLABLE_OPTIONS = frozenset({"step_timeout", "agents", "max_failed_groups"})
