"""Agent Lightning's ``agentlightning:`` config section, mapped onto aglverl's keys.

An Agent Lightning v1.0 training config is verl's Hydra config plus that section (its ``verl/config.yaml``) and
two keys it adds to verl's sections. :func:`map_section` takes them out of a run's overrides and writes what
each means in aglverl's terms, so ``AsyncVERL`` trains such a config as it is. Keys the section leaves out
take Agent Lightning's defaults (``rollout_timeout_seconds: 1800``, ``reward_fillna_value: 0.0``, ...).

=====================================================  ==============================================================
``agentlightning.``                                    aglverl
=====================================================  ==============================================================
``agl_base_url``                                       the task server's address (``aglverl.host`` / ``port``): the
                                                       one URL Agent Lightning's controllers and agents are given
``agl_key``                                            ``aglverl.token`` (Bearer or ``x-api-key``, as Agent Lightning)
``rollout_timeout_seconds``                            ``aglverl.processes.timeout_seconds`` (the attempt's deadline),
                                                       and the rollouts' ``config.timeout_seconds``
``local.agent_class``, ``local.env_map``               ``aglverl.processes.agent_class`` / ``env_map`` (the built-in
                                                       runner), and the rollouts' ``config.local``
``k8s.job_template_path``                              the template (read at construction) in the rollouts'
                                                       ``config.k8s.job_template``
``reward_fillna_value``                                ``aglverl.processes.reward_fillna_value``: an attempt that ends
                                                       well without a reward event gets it (``null``: it fails)
``trace_aggregator.level``                             ``aglverl.signal.trajectory``: ``trajectory`` -> ``merge``,
                                                       ``transition`` -> ``per_call``
``trace_aggregator.trajectory_max_prompt_length`` /    ``data.max_prompt_length`` / ``max_response_length`` (the
``trajectory_max_response_length``                     merged rows' widths), when given with ``level: trajectory``
``hooks``, ``max_ppo_update_times``,                   only their defaults (``null`` / ``false``): each other value is
``async_rollout.*``                                    an error saying why and what aglverl does instead
``algorithm.enable_rollout_level_advantage: true``     what aglverl does anyway (a rollout is one GRPO member)
``actor.policy_loss.loss_mode: per_rollout_mean``      ``aglverl.signal.turn_weighting: per_rollout`` with verl's
                                                       ``actor.loss_agg_mode: seq-mean-token-mean``
=====================================================  ==============================================================

A value that conflicts with the aglverl or verl key it maps onto (both set, differently) is an error naming both.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..config_errors import ConfigError, unknown_key_message
from ..models import check_reward
from .cursor import MAX_FINISHED_ROLLOUTS, TERMINAL_GRACE_SECONDS
from .events import MAX_EVENT_BYTES, MAX_EVENT_BYTES_PER_ROLLOUT, MAX_EVENTS_PER_ROLLOUT
from .wire import RolloutConfig, RolloutK8sConfig, RolloutLocalConfig

__all__ = [
    "SECTION_DEFAULTS",
    "AgentLightningSettings",
    "map_section",
    "refuse_verl_keys",
    "rollout_config_for",
]

#: Agent Lightning 1.0.2's ``agentlightning:`` section, its defaults (``verl/config.yaml``).
SECTION_DEFAULTS: dict[str, Any] = {
    "agl_base_url": "http://localhost:8080",
    "agl_key": "",
    "hooks": None,
    "rollout_timeout_seconds": 1800,
    "local": {"agent_class": None, "env_map": {}},
    "k8s": {"job_template_path": None},
    "reward_fillna_value": 0.0,
    "max_ppo_update_times": None,
    "trace_aggregator": {
        "level": "trajectory",
        "trajectory_max_prompt_length": 2048,
        "trajectory_max_response_length": 8192,
    },
    "async_rollout": {"enabled": False, "async_train_batch_size": None},
}


@dataclass(frozen=True)
class AgentLightningSettings:
    """What a daemon's Agent Lightning API needs to know of its run.

    - ``rollout_config``: the ``config`` of the rollouts the run queues (what Agent Lightning's controllers run);
    - ``reward_fillna_value``: the reward of an attempt a controller reports succeeded without a reward event
      (``None``: the attempt fails);
    - ``trainer_owns_gate``: a trainer starts the model servers and holds the calls around its weight updates,
      so the API's models and pause / resume routes refuse to change them;
    - ``accept_rollouts``: whether ``POST /api/rollouts`` queues work (a daemon without a trainer: ``aglverl
      serve``); a trainer's daemon refuses it with a 403 unless its config allows it (``aglverl.
      accept_outside_rollouts``): the run's agents would run whatever input a caller sends;
    - ended rollouts created through the API are kept until a caller deletes them, or for
      ``terminal_grace_seconds`` after a page of the terminal cursor last listed them, and at most
      ``max_finished_rollouts`` of them (the oldest go first, read or not);
    - the events agents post: at most ``max_events_per_rollout`` events and ``max_event_bytes_per_rollout`` bytes
      (their data as JSON, how they are kept) per rollout, ``max_event_bytes`` for all rollouts together (a post
      past one is refused with a 413 naming it).
    """

    rollout_config: RolloutConfig = field(default_factory=RolloutConfig)
    reward_fillna_value: float | None = None
    trainer_owns_gate: bool = False
    accept_rollouts: bool = True
    max_finished_rollouts: int = MAX_FINISHED_ROLLOUTS
    terminal_grace_seconds: float = TERMINAL_GRACE_SECONDS
    max_events_per_rollout: int = MAX_EVENTS_PER_ROLLOUT
    max_event_bytes_per_rollout: int = MAX_EVENT_BYTES_PER_ROLLOUT
    max_event_bytes: int = MAX_EVENT_BYTES


def rollout_config_for(processes: Any, job_template: str | None = None) -> RolloutConfig:
    """The rollouts' config from the built-in runner's options (``aglverl.processes``): the same agent class,
    environment and timeout for Agent Lightning's controllers; the Kubernetes Job template if there is one."""
    local = None
    if processes.agent_class is not None:
        local = RolloutLocalConfig(agent_class=processes.agent_class, env_map=dict(processes.env_map))
    return RolloutConfig(
        timeout_seconds=max(1, math.ceil(processes.timeout_seconds)),
        local=local,
        k8s=RolloutK8sConfig(job_template=job_template) if job_template is not None else None,
    )


def _error(message: str) -> Exception:
    return ConfigError(message)


def _get(tree: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _put(tree: dict[str, Any], dotted: str, value: Any, source: str, *, secret: bool = False) -> None:
    """Set ``dotted`` unless the user set it to something else (then an error naming both keys, and their values
    unless ``secret``). Only for a key of the section the user set: a default goes by :func:`_default`."""
    present, current = _get(tree, dotted)
    if present and current != value:
        if secret:
            raise _error(f"{source} and {dotted} disagree (their values are not shown): set only one of them")
        raise _error(f"{source} ({value!r}) and {dotted} ({current!r}) disagree: set only one of them")
    _set(tree, dotted, value)


def _default(tree: dict[str, Any], dotted: str, value: Any, source: str = "") -> None:
    """Set ``dotted`` to an Agent Lightning default unless the user set it (the user's value stands)."""
    if not _get(tree, dotted)[0]:
        _set(tree, dotted, value)


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _pop(tree: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    *parents, leaf = dotted.split(".")
    present, node = _get(tree, ".".join(parents)) if parents else (True, tree)
    if not present or not isinstance(node, dict) or leaf not in node:
        return False, None
    return True, node.pop(leaf)


def _check_keys(values: Mapping[str, Any], defaults: Mapping[str, Any], path: str) -> None:
    if not isinstance(values, Mapping):
        raise _error(f"{path} must be a mapping, got {values!r}")
    for key, value in values.items():
        if key not in defaults:
            raise _error(unknown_key_message(f"{path}.{key}", key, defaults))
        if isinstance(defaults[key], dict) and defaults[key] and value is not None:
            _check_keys(value, defaults[key], f"{path}.{key}")


def _merged(defaults: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(defaults)
    for key, value in values.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict) and out[key]:
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def _number(value: Any, key: str, *, low: float, nullable: bool = False) -> float | None:
    if value is None and nullable:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < low
    ):
        null = " or null" if nullable else ""
        raise _error(f"agentlightning.{key} must be a number >= {low:g}{null}, got {value!r}")
    return float(value)


def map_section(overrides: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The run's nested overrides with the ``agentlightning:`` section (and Agent Lightning's two verl keys)
    mapped onto aglverl's and verl's keys (see the module docstring), and the Kubernetes Job template the
    section names (read now), if any. Raises ``ConfigError`` naming a key aglverl cannot honour, and why."""
    user: dict[str, Any] = {k: v for k, v in overrides.items()}
    for name in ("algorithm", "actor_rollout_ref", "aglverl"):
        if isinstance(user.get(name), Mapping):
            user[name] = _deep_copy(user[name])
    _map_verl_additions(user)
    section = user.pop("agentlightning", None)
    if section is None:
        return user, None
    _check_keys(section, SECTION_DEFAULTS, "agentlightning")
    given = dict(section)
    agl = _merged(SECTION_DEFAULTS, section)
    _refuse_unsupported(agl)
    if "agl_base_url" in given:
        host, port = _address(agl["agl_base_url"])
        _put(user, "aglverl.host", host, "agentlightning.agl_base_url")
        _put(user, "aglverl.port", port, "agentlightning.agl_base_url")
    key = agl["agl_key"]
    if key not in (None, ""):
        if not isinstance(key, str):
            raise _error(f"agentlightning.agl_key must be a string, got a value of type {type(key).__name__}")
        _put(user, "aglverl.token", key, "agentlightning.agl_key", secret=True)
    timeout = _number(agl["rollout_timeout_seconds"], "rollout_timeout_seconds", low=1)
    place = _put if "rollout_timeout_seconds" in given else _default
    place(user, "aglverl.processes.timeout_seconds", timeout, "agentlightning.rollout_timeout_seconds")
    local = agl["local"] or {}
    if local.get("agent_class") is not None:
        _put(user, "aglverl.processes.agent_class", local["agent_class"], "agentlightning.local.agent_class")
    if local.get("env_map"):
        _put(user, "aglverl.processes.env_map", dict(local["env_map"]), "agentlightning.local.env_map")
    fillna = _number(agl["reward_fillna_value"], "reward_fillna_value", low=-math.inf, nullable=True)
    if fillna is not None:
        try:
            check_reward(fillna, "agentlightning.reward_fillna_value")  # finite as float32, as every reward
        except ValueError as exc:
            raise _error(str(exc)) from None
    place = _put if "reward_fillna_value" in given else _default
    place(user, "aglverl.processes.reward_fillna_value", fillna, "agentlightning.reward_fillna_value")
    _map_trace_aggregator(user, agl["trace_aggregator"] or {}, given.get("trace_aggregator") or {})
    return user, _job_template((agl["k8s"] or {}).get("job_template_path"))


def _deep_copy(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def _address(url: Any) -> tuple[str, int]:
    """``agl_base_url`` as the task server's host and port: aglverl serves plain HTTP at the URL's root."""
    if not isinstance(url, str):
        raise _error(f"agentlightning.agl_base_url must be a URL string, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise _error(
            f"agentlightning.agl_base_url must be http://host:port (the address aglverl's task server binds; it "
            f"serves Agent Lightning's API at its root, over plain HTTP), got {url!r}"
        )
    return parts.hostname, parts.port or 80


def _refuse_unsupported(agl: Mapping[str, Any]) -> None:
    if agl["hooks"] is not None:
        raise _error(
            "agentlightning.hooks cannot be honoured: Agent Lightning's RolloutHooks subclass "
            "agentlightning.hooks.RolloutHooks (Python >= 3.12), which aglverl's training process does not load; "
            "read rollouts and events through Agent Lightning's API on aglverl's task server instead "
            "(GET /api/rollouts/terminal, GET /api/rollouts/{id}/events)"
        )
    if agl["max_ppo_update_times"] is not None:
        raise _error(
            "agentlightning.max_ppo_update_times cannot be honoured: aglverl trains every row of a step (verl pads "
            "the last mini-batch instead of dropping rows); bound the updates with "
            "actor_rollout_ref.actor.ppo_mini_batch_size and ppo_epochs"
        )
    asynchronous = agl["async_rollout"] or {}
    if asynchronous.get("enabled") or asynchronous.get("async_train_batch_size") is not None:
        raise _error(
            "agentlightning.async_rollout cannot be honoured: aglverl's asynchronous training is verl's V1 "
            "trainer modes (trainer.v1.trainer_mode: colocate_async or separate_async: rollouts run ahead of the "
            "trainer, staleness bounded by trainer.v1.sampler.max_off_policy_threshold)"
        )


def _map_trace_aggregator(
    user: dict[str, Any], aggregator: Mapping[str, Any], given: Mapping[str, Any]
) -> None:
    level = aggregator.get("level")
    if level not in ("trajectory", "transition"):
        raise _error(
            f"agentlightning.trace_aggregator.level must be 'trajectory' or 'transition', got {level!r}"
        )
    place = _put if "level" in given else _default
    place(
        user,
        "aglverl.signal.trajectory",
        "merge" if level == "trajectory" else "per_call",
        "agentlightning.trace_aggregator.level",
    )
    if level != "trajectory":
        return
    for key, target in (
        ("trajectory_max_prompt_length", "data.max_prompt_length"),
        ("trajectory_max_response_length", "data.max_response_length"),
    ):
        if key in given:
            value = given[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _error(f"agentlightning.trace_aggregator.{key} must be an integer >= 1, got {value!r}")
            _put(user, target, value, f"agentlightning.trace_aggregator.{key}")


def _map_verl_additions(user: dict[str, Any]) -> None:
    """The keys Agent Lightning's verl config adds to verl's own sections."""
    present, value = _pop(user, "algorithm.enable_rollout_level_advantage")
    if present and value is not True:
        raise _error(
            f"algorithm.enable_rollout_level_advantage: {value!r} cannot be honoured: aglverl's GRPO groups are "
            "always made of rollouts (a rollout is one member whatever its number of rows), which is what true means"
        )
    present, mode = _get(user, "actor_rollout_ref.actor.policy_loss.loss_mode")
    if not present or mode not in ("per_rollout_mean", "cispo_per_rollout_mean"):
        return
    if mode == "cispo_per_rollout_mean":
        raise _error(
            "actor_rollout_ref.actor.policy_loss.loss_mode: cispo_per_rollout_mean is Agent Lightning's own loss, "
            "not registered in aglverl's verl; use per_rollout_mean (mapped onto verl's vanilla loss) or a verl loss"
        )
    _pop(user, "actor_rollout_ref.actor.policy_loss.loss_mode")
    _put(
        user, "aglverl.signal.turn_weighting", "per_rollout", "actor_rollout_ref.actor.policy_loss.loss_mode"
    )
    if not _get(user, "actor_rollout_ref.actor.loss_agg_mode")[0]:
        _put(
            user,
            "actor_rollout_ref.actor.loss_agg_mode",
            "seq-mean-token-mean",
            "actor_rollout_ref.actor.policy_loss.loss_mode",
        )


def _job_template(path: Any) -> str | None:
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise _error(f"agentlightning.k8s.job_template_path must be a path, got {path!r}")
    try:
        with open(os.path.expanduser(os.fspath(path)), encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise _error(
            f"agentlightning.k8s.job_template_path: cannot read {os.fspath(path)!r}: {exc.strerror}"
        ) from None


#: Keys only ``agl.VERL``'s section has (Agent Lightning 1.0's has a ``trace_aggregator`` too, without these).
_VERL_ONLY_KEYS = (("port",), ("trace_aggregator", "debug"), ("trace_aggregator", "mismatch_log_dir"))


def refuse_verl_keys(overrides: Mapping[str, Any]) -> None:
    """For ``AsyncVERL``, which reads Agent Lightning 1.0's section: a key only ``agl.VERL``'s section has is a
    :class:`~aglverl.config_errors.ConfigError` saying which entry point trains such a config."""
    section = overrides.get("agentlightning")
    for path in _VERL_ONLY_KEYS:
        node: Any = section
        for part in path:
            node = node.get(part) if isinstance(node, Mapping) else None
            if node is None:
                break
        else:
            raise ConfigError(
                f"agentlightning.{'.'.join(path)} is a key of agl.VERL's section (Agent Lightning 0.2/0.3), not of "
                "Agent Lightning 1.0's, which AsyncVERL reads: train an agl.VERL config with "
                "aglverl.agent_lightning.VERL inside agl.Trainer.fit (or `aglverl fit SCRIPT`)"
            )
