"""Agent Lightning's ``agentlightning:`` config section in ``AsyncVERL``: each key mapped onto aglverl's, the keys
aglverl cannot honour refused at construction with the reason, conflicts named (no Agent Lightning package)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from aglverl.agl10.config import map_section
from aglverl.algorithm import AsyncVERL, ConfigError

BASE: dict[str, Any] = {
    "data": {"train_batch_size": 2, "max_response_length": 4},
    "aglverl": {"journal": None},
}


def test_without_the_section_the_overrides_are_unchanged() -> None:
    assert map_section(BASE) == (BASE, None)


def test_each_key_maps_onto_aglverls(tmp_path: Path) -> None:
    template = tmp_path / "job.yaml.j2"
    template.write_text("kind: Job\n")
    section = {
        "agl_base_url": "http://127.0.0.1:18080",
        "agl_key": "k",
        "rollout_timeout_seconds": 90,
        "local": {"agent_class": "pkg.mod:Agent", "env_map": {"Q": "input.q"}},
        "k8s": {"job_template_path": str(template)},
        "reward_fillna_value": -1.0,
        "trace_aggregator": {"level": "transition"},
    }
    mapped, job = map_section({**BASE, "agentlightning": section})
    assert job == "kind: Job\n"
    assert mapped["aglverl"] == {
        "journal": None,
        "host": "127.0.0.1",
        "port": 18080,
        "token": "k",
        "processes": {
            "timeout_seconds": 90.0,
            "agent_class": "pkg.mod:Agent",
            "env_map": {"Q": "input.q"},
            "reward_fillna_value": -1.0,
        },
        "signal": {"trajectory": "per_call"},
    }
    assert "agentlightning" not in mapped and mapped["data"] == BASE["data"]


def test_agent_lightnings_defaults_apply_to_keys_left_out() -> None:
    mapped, job = map_section({"agentlightning": {"local": {"agent_class": "m:A"}}})
    processes = mapped["aglverl"]["processes"]
    assert processes == {"timeout_seconds": 1800.0, "agent_class": "m:A", "reward_fillna_value": 0.0}
    assert mapped["aglverl"]["signal"] == {"trajectory": "merge"} and job is None
    assert (
        "port" not in mapped["aglverl"] and "token" not in mapped["aglverl"]
    )  # agl_base_url only when given


def test_trajectory_widths_become_the_rows_widths_and_conflicts_name_both_keys() -> None:
    section = {"trace_aggregator": {"level": "trajectory", "trajectory_max_response_length": 16}}
    mapped, _ = map_section({"agentlightning": section})
    assert mapped["data"] == {"max_response_length": 16}
    with pytest.raises(
        ConfigError,
        match=r"agentlightning\.trace_aggregator\.trajectory_max_response_length \(16\) "
        r"and data\.max_response_length \(4\) disagree",
    ):
        map_section({**BASE, "agentlightning": section})


def test_messages_name_only_keys_the_user_set_and_never_a_secret() -> None:
    """Issue 39, finding 8. A key the section leaves out takes Agent Lightning's default only where the user set
    no value of their own: ``aglverl.processes.timeout_seconds: 600`` alone is no conflict with a
    ``rollout_timeout_seconds`` the user never wrote (nor ``reward_fillna_value``, nor the trace level). A conflict
    between the two keys, or a key of the wrong type, never prints the key itself."""
    user = {
        "aglverl": {
            "processes": {"timeout_seconds": 600, "reward_fillna_value": None},
            "signal": {"trajectory": "per_call"},
        },
        "agentlightning": {"local": {"agent_class": "m:A"}},
    }
    mapped, _ = map_section(user)
    assert mapped["aglverl"]["processes"] == {
        "timeout_seconds": 600,
        "reward_fillna_value": None,
        "agent_class": "m:A",
    }
    assert mapped["aglverl"]["signal"] == {"trajectory": "per_call"}
    with pytest.raises(ConfigError) as conflict:
        map_section({"aglverl": {"token": "s3cret-b"}, "agentlightning": {"agl_key": "s3cret-a"}})
    message = str(conflict.value)
    assert "agentlightning.agl_key and aglverl.token disagree" in message
    assert "s3cret" not in message
    with pytest.raises(ConfigError) as wrong_type:
        map_section({"agentlightning": {"agl_key": 12345678}})
    assert "agl_key must be a string, got a value of type int" in str(
        wrong_type.value
    ) and "12345678" not in str(wrong_type.value)
    with pytest.raises(
        ConfigError,
        match=r"rollout_timeout_seconds \(90\.0\) and aglverl\.processes\.timeout_seconds \(600\)",
    ):
        map_section({**user, "agentlightning": {"rollout_timeout_seconds": 90}})  # given both: both named


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"hooks": "hooks.py"}, r"agentlightning\.hooks cannot be honoured: .*RolloutHooks"),
        ({"max_ppo_update_times": 2}, r"max_ppo_update_times cannot be honoured: aglverl trains every row"),
        ({"async_rollout": {"enabled": True}}, r"async_rollout cannot be honoured: .*colocate_async"),
        ({"agl_base_url": "https://x:1"}, r"agl_base_url must be http://host:port"),
        ({"agl_base_url": "http://x:1/api"}, r"agl_base_url must be http://host:port"),
        ({"rollout_timeout_seconds": 0}, r"rollout_timeout_seconds must be a number >= 1"),
        ({"reward_fillna_value": 1e39}, r"reward_fillna_value 1e\+39: not a finite float32 number"),
        ({"trace_aggregator": {"level": "turn"}}, r"level must be 'trajectory' or 'transition'"),
        (
            {"k8s": {"job_template_path": "/nonexistent/job.j2"}},
            r"job_template_path: cannot read '/nonexistent/job.j2'",
        ),
        ({"locall": {}}, r"unknown config key 'agentlightning\.locall'; did you mean 'local'"),
        ({"local": {"agent_klass": "a:B"}}, r"unknown config key 'agentlightning\.local\.agent_klass'"),
    ],
)
def test_keys_aglverl_cannot_honour_are_refused_saying_why(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        map_section({"agentlightning": section})


def test_agent_lightnings_verl_additions_map_or_are_refused() -> None:
    mapped, _ = map_section(
        {
            "algorithm": {"enable_rollout_level_advantage": True, "adv_estimator": "grpo"},
            "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "per_rollout_mean"}}},
        }
    )
    assert mapped["algorithm"] == {"adv_estimator": "grpo"}
    assert mapped["actor_rollout_ref"]["actor"] == {"policy_loss": {}, "loss_agg_mode": "seq-mean-token-mean"}
    assert mapped["aglverl"] == {"signal": {"turn_weighting": "per_rollout"}}
    with pytest.raises(ConfigError, match="enable_rollout_level_advantage: False cannot be honoured"):
        map_section({"algorithm": {"enable_rollout_level_advantage": False}})
    with pytest.raises(ConfigError, match="cispo_per_rollout_mean is Agent Lightning's own loss"):
        map_section(
            {"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "cispo_per_rollout_mean"}}}}
        )


def test_async_verl_takes_the_section_and_gives_its_rollouts_the_controllers_config(tiny_model: Path) -> None:
    config = {
        **BASE,
        "agentlightning": {"agl_key": "k", "local": {"agent_class": "m:Agent", "env_map": {"A": "input"}}},
        "algorithm": {"adv_estimator": "grpo", "enable_rollout_level_advantage": True},
    }
    algo = AsyncVERL(config)
    assert algo.options.token == "k" and algo.options.processes.agent_class == "m:Agent"
    rollout = algo.agent_lightning.rollout_config
    assert (
        rollout.timeout_seconds == 1800
        and rollout.local is not None
        and rollout.local.env_map == {"A": "input"}
    )
    assert algo.agent_lightning.reward_fillna_value == 0.0 and algo.agent_lightning.trainer_owns_gate


def test_async_verl_refuses_an_agent_function_beside_agent_processes(tiny_model: Path) -> None:
    async def agent(task: Any, llm: Any) -> float:
        return 0.0

    with pytest.raises(ConfigError, match="both agent= and agents to run as processes"):
        AsyncVERL({**BASE, "agentlightning": {"local": {"agent_class": "m:A"}}}, agent=agent)


def test_agent_processes_by_default_are_bounded_by_the_machine(tiny_model: Path) -> None:
    """Issue 39, finding 10: without ``aglverl.agents``, a step of 64 x 8 rollouts runs at most 4 spawned agent
    processes per core (16 per core for Python agents the fork server forks), not one per rollout; ``aglverl.agents``
    stands when given."""
    from aglverl.algorithm.async_verl import agent_count

    cores = len(os.sched_getaffinity(0))
    big = {
        **BASE,
        "data": {"train_batch_size": 64, "max_response_length": 4},
        "actor_rollout_ref": {"rollout": {"n": 8}},
    }
    for processes, per_core in (({"command": ["sh", "agent.sh"]}, 4), ({"agent_class": "m:A"}, 16)):
        algo = AsyncVERL({**big, "aglverl": {"journal": None, "processes": processes}})
        assert 1 <= agent_count(algo.config, algo.options) <= min(512, per_core * cores)
    algo.options = dataclasses.replace(algo.options, agents=100)
    assert agent_count(algo.config, algo.options) == 100


@pytest.mark.parametrize(
    ("processes", "message"),
    [
        ({"command": ["no-such-agent-39"]}, r"'no-such-agent-39' is not installed"),
        (
            {"agent_class": "no_such_module_39:Agent"},
            r"cannot be loaded by .*No module named 'no_such_module_39'",
        ),
    ],
)
def test_async_verl_names_a_missing_agent_before_ray(
    tiny_model: Path, processes: dict[str, Any], message: str
) -> None:
    """Issue 39, finding 1: an agent program that is not installed, or an agent class its Python cannot load, is
    a ``ConfigError`` naming it when the run starts, before Ray and verl (not at the first rollout)."""
    import anyio
    import ray

    algo = AsyncVERL({**BASE, "aglverl": {"journal": None, "processes": processes}})
    with pytest.raises(ConfigError, match=message):
        anyio.run(algo.run, [{"prompt": "p"}] * 4)
    assert not ray.is_initialized()
