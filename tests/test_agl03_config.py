"""Agent Lightning 0.2/0.3's ``agentlightning:`` section (``agl.VERL``'s config) mapped onto aglverl's keys by
:func:`aglverl.agl03.config.map_verl_section`: each key mapped, or refused naming it and why."""

from __future__ import annotations

from typing import Any

import pytest

from aglverl.agl03.config import map_verl_section
from aglverl.config_errors import ConfigError


def _mapped(section: Any, **rest: Any) -> dict[str, Any]:
    return map_verl_section({"agentlightning": section, **rest})


def test_no_section_leaves_the_overrides_as_they_are() -> None:
    overrides = {"data": {"train_batch_size": 4}}
    assert map_verl_section(overrides) == overrides


def test_port_is_the_task_servers_port() -> None:
    assert _mapped({"port": 9999}) == {"aglverl": {"port": 9999}}


def test_trace_aggregator_level_picks_the_row_layout() -> None:
    assert _mapped({"trace_aggregator": {"level": "transition"}}) == {
        "aglverl": {"signal": {"trajectory": "per_call"}}
    }
    assert _mapped({"trace_aggregator": {"level": "trajectory"}}) == {
        "aglverl": {"signal": {"trajectory": "merge"}}
    }
    assert _mapped({"trace_aggregator": {}}) == {}  # left out: aglverl's default (merge)


def test_trajectory_widths_are_the_merged_rows_widths_and_do_nothing_under_transition() -> None:
    widths = {"trajectory_max_prompt_length": 4096, "trajectory_max_response_length": 34384}
    assert _mapped({"trace_aggregator": {"level": "trajectory", **widths}}) == {
        "aglverl": {"signal": {"trajectory": "merge"}},
        "data": {"max_prompt_length": 4096, "max_response_length": 34384},
    }
    assert "data" not in _mapped({"trace_aggregator": {"level": "transition", **widths}})


def test_the_docs_trajectory_widths_replace_the_rows_widths_and_keep_each_calls_bound() -> None:
    """``agl.VERL``'s documented trajectory aggregation: ``data.max_response_length`` (2048) bounds each call,
    the trajectory widths are the merged rows' (as ``agl.VERL`` builds its batch); left out (aglverl merges by
    default) they apply the same way, and under ``aglverl.signal.trajectory: per_call`` they do nothing."""
    section = {
        "trace_aggregator": {"trajectory_max_prompt_length": 4096, "trajectory_max_response_length": 34384}
    }
    data = {"max_prompt_length": 4096, "max_response_length": 2048}
    assert _mapped(
        {"trace_aggregator": {"level": "trajectory", **section["trace_aggregator"]}}, data=data
    ) == {
        "aglverl": {"signal": {"trajectory": "merge"}},
        "data": {"max_prompt_length": 4096, "max_response_length": 34384},
        "actor_rollout_ref": {"rollout": {"response_length": 2048, "max_model_len": 4096 + 34384}},
    }
    assert _mapped(section, data={"max_prompt_length": 512})["data"] == {
        "max_prompt_length": 4096,
        "max_response_length": 34384,  # no per-call bound given: calls are bounded by the rows' width
    }
    per_call = _mapped(section, data=data, aglverl={"signal": {"trajectory": "per_call"}})
    assert per_call["data"] == data and "actor_rollout_ref" not in per_call
    with pytest.raises(
        ConfigError,
        match=r"data.max_response_length \(2048\) and actor_rollout_ref.rollout.response_length \(1024\) disagree",
    ):
        _mapped(section, data=data, actor_rollout_ref={"rollout": {"response_length": 1024}})


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"prot": 1}, r"unknown config key 'agentlightning.prot'; did you mean 'port'"),
        (
            {"trace_aggregator": {"levle": "x"}},
            r"'agentlightning.trace_aggregator.levle'; did you mean 'level'",
        ),
        ({"port": "9999"}, r"agentlightning.port must be a port number"),
        ({"trace_aggregator": {"level": "turn"}}, r"level must be 'trajectory' or 'transition', got 'turn'"),
        ({"trace_aggregator": {"debug": True}}, r"debug: True cannot be honoured.*batch/n_calls_drifted"),
        ({"trace_aggregator": {"trajectory_max_prompt_length": 0}}, r"must be an integer >= 1, got 0"),
        (
            {"agl_base_url": "http://h:1"},
            r"agentlightning.agl_base_url is a key of Agent Lightning 1.0's section",
        ),
        ("port=1", r"agentlightning must be a mapping"),
    ],
)
def test_bad_keys_are_refused_naming_them(section: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _mapped(section)


def test_mismatch_log_dir_and_debug_false_are_accepted() -> None:
    assert _mapped({"trace_aggregator": {"debug": False, "mismatch_log_dir": "./m"}}) == {}


def test_the_callers_overrides_are_not_changed() -> None:
    overrides = {"agentlightning": {"port": 1}, "aglverl": {"agents": 4}}
    map_verl_section(overrides)
    assert overrides == {"agentlightning": {"port": 1}, "aglverl": {"agents": 4}}


@pytest.mark.parametrize("section", [{"port": 9999}, {"trace_aggregator": {"debug": False}}])
def test_async_verl_names_the_entry_point_of_an_agl_verl_section(section: dict[str, Any]) -> None:
    """``AsyncVERL`` reads Agent Lightning 1.0's section; a key only ``agl.VERL``'s has says which class trains it."""
    from aglverl.algorithm import AsyncVERL

    with pytest.raises(ConfigError, match=r"is a key of agl.VERL's section.*aglverl.agent_lightning.VERL"):
        AsyncVERL({"agentlightning": section})
