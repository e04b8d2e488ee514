"""Agent Lightning 0.2/0.3's ``agentlightning:`` section (``agl.VERL``'s config), mapped onto aglverl's keys.

``agl.VERL(config)`` takes verl's overrides plus this section (0.3's ``agentlightning/verl/config.yaml``; 0.2 has
``port`` alone). :func:`map_verl_section` takes it out of the overrides and writes what each key means in
aglverl's terms, so :class:`aglverl.agl03.VERL` trains the config as it is. Agent Lightning 1.0's
section of the same name (``agl_base_url``, ``rollout_timeout_seconds``, ...) is another section:
:class:`~aglverl.algorithm.AsyncVERL` reads that one (:mod:`aglverl.agl10.config`); which one a config holds is decided by the
entry point that constructs the run, and a 1.0 key given to ``VERL`` (or a 0.3 key to ``AsyncVERL``) is an error
that says so.

======================================================  ============================================================
``agentlightning.``                                     aglverl
======================================================  ============================================================
``port``                                                ``aglverl.port``: the task server, which serves Agent
                                                        Lightning 0.1's protocol (``VERL.get_client()``), as
                                                        ``AgentLightningServer`` did on that port
``trace_aggregator.level``                              ``aglverl.signal.trajectory``: ``trajectory`` -> ``merge``
                                                        (one row per conversation), ``transition`` -> ``per_call``;
                                                        left out: aglverl's default, ``merge``
``trace_aggregator.trajectory_max_prompt_length``       ``data.max_prompt_length`` (the merged rows' prompt width), in
                                                        place of the one given there, when rows are merged
``trace_aggregator.trajectory_max_response_length``     ``data.max_response_length`` (the merged rows' width), when
                                                        rows are merged; ``data.max_response_length`` given too is
                                                        each call's bound, as in ``agl.VERL``:
                                                        ``actor_rollout_ref.rollout.response_length`` (the calls'
                                                        ``max_tokens``), and the engine's context
                                                        (``rollout.max_model_len``, unless given) holds a whole
                                                        conversation. With ``level: transition`` both do nothing,
                                                        as in ``agl.VERL``
``trace_aggregator.debug: true``                        refused: aglverl builds rows from the ids the engine saw
                                                        (there is no retokenization to diagnose) and counts every
                                                        call that does not extend its conversation in
                                                        ``batch/n_calls_drifted``
``trace_aggregator.mismatch_log_dir``                   nothing (it only applies with ``debug: true``)
======================================================  ============================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..agl10.config import _check_keys, _get, _merged, _put
from ..config_errors import ConfigError

__all__ = ["VERL_SECTION_DEFAULTS", "map_verl_section"]

#: Agent Lightning 0.3.0's ``agentlightning:`` section, its defaults (``agentlightning/verl/config.yaml``).
VERL_SECTION_DEFAULTS: dict[str, Any] = {
    "port": 9999,
    "trace_aggregator": {
        "level": "transition",
        "trajectory_max_prompt_length": 2048,
        "trajectory_max_response_length": 8192,
        "debug": False,
        "mismatch_log_dir": "./mismatch_cases",
    },
}

#: Keys of Agent Lightning 1.0's section (read by ``AsyncVERL``), named when one reaches ``VERL``.
_SECTION_1_0_KEYS = frozenset(
    {
        "agl_base_url",
        "agl_key",
        "hooks",
        "rollout_timeout_seconds",
        "local",
        "k8s",
        "reward_fillna_value",
        "max_ppo_update_times",
        "async_rollout",
    }
)


def map_verl_section(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The run's nested overrides with Agent Lightning 0.2/0.3's ``agentlightning:`` section mapped onto
    aglverl's and verl's keys (see the module docstring). Raises :class:`~aglverl.config_errors.ConfigError`
    naming a key that is unknown or cannot be honoured, and why."""
    user: dict[str, Any] = dict(overrides)
    section = user.pop("agentlightning", None)
    if section is None:
        return user
    for name in ("aglverl", "data", "actor_rollout_ref"):
        if isinstance(user.get(name), Mapping):
            user[name] = _copy(user[name])
    if isinstance(section, Mapping):
        for key in section:
            if key in _SECTION_1_0_KEYS:
                raise ConfigError(
                    f"agentlightning.{key} is a key of Agent Lightning 1.0's section, not of agl.VERL's (0.2/0.3: "
                    "port, trace_aggregator): train a 1.0 config with aglverl.AsyncVERL(config)"
                )
    _check_keys(section, VERL_SECTION_DEFAULTS, "agentlightning")
    given: Mapping[str, Any] = section
    if "port" in given:
        port = given["port"]
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"agentlightning.port must be a port number (0-65535), got {port!r}")
        _put(user, "aglverl.port", port, "agentlightning.port")
    aggregator_given = given.get("trace_aggregator") or {}
    aggregator = _merged(VERL_SECTION_DEFAULTS["trace_aggregator"], aggregator_given)
    _map_trace_aggregator(user, aggregator, aggregator_given)
    return user


def _copy(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def _map_trace_aggregator(
    user: dict[str, Any], aggregator: Mapping[str, Any], given: Mapping[str, Any]
) -> None:
    """``debug`` refused; ``level`` onto aglverl's row layout (left out: aglverl's, ``merge`` unless
    ``aglverl.signal.trajectory`` says ``per_call``); the trajectory widths when rows are merged."""
    if aggregator["debug"] not in (False, None):
        raise ConfigError(
            f"agentlightning.trace_aggregator.debug: {aggregator['debug']!r} cannot be honoured: it diagnoses "
            "agl.VERL's retokenized traces, and aglverl has none (rows are built from the exact ids the engine "
            "saw; a call that does not extend its conversation's ids starts a new row and is counted in "
            "batch/n_calls_drifted every step); remove it"
        )
    level = given.get("level")
    if level is not None and level not in ("trajectory", "transition"):
        raise ConfigError(
            f"agentlightning.trace_aggregator.level must be 'trajectory' or 'transition', got {level!r}"
        )
    if level is None:
        level = (
            "transition" if _get(user, "aglverl.signal.trajectory") == (True, "per_call") else "trajectory"
        )
    else:
        trajectory = "merge" if level == "trajectory" else "per_call"
        _put(user, "aglverl.signal.trajectory", trajectory, "agentlightning.trace_aggregator.level")
    if level == "transition":
        return  # agl.VERL reads the trajectory widths only when it merges
    for key in ("trajectory_max_prompt_length", "trajectory_max_response_length"):
        if key in given:
            value = given[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"agentlightning.trace_aggregator.{key} must be an integer >= 1, got {value!r}"
                )
    if "trajectory_max_prompt_length" in given:
        # the rows' prompt width, in place of data's, as agl.VERL builds its batch
        user.setdefault("data", {})["max_prompt_length"] = given["trajectory_max_prompt_length"]
    if "trajectory_max_response_length" in given:
        data = user.setdefault("data", {})
        per_call = data.get("max_response_length")
        if per_call is not None:
            # agl.VERL: data.max_response_length bounds each call, the trajectory width each merged row
            _put(user, "actor_rollout_ref.rollout.response_length", per_call, "data.max_response_length")
            prompt = data.get("max_prompt_length")
            rollout = user.setdefault("actor_rollout_ref", {}).setdefault("rollout", {})
            if isinstance(prompt, int) and rollout.get("max_model_len") is None:
                # the engine's context holds a whole conversation (not one call's prompt + answer)
                rollout["max_model_len"] = prompt + given["trajectory_max_response_length"]
        data["max_response_length"] = given["trajectory_max_response_length"]
