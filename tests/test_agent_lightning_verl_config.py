"""Agent Lightning 0.2/0.3's ``agentlightning:`` section (``agl.VERL``'s config) mapped onto aglverl's keys by
:func:`aglverl.agent_lightning.verl_config.map_verl_section`: each key mapped, or refused naming it and why."""

from __future__ import annotations

from typing import Any

import pytest

from aglverl.agent_lightning.verl_config import map_verl_section
from aglverl.config_errors import ConfigError


def _mapped(section: Any, **rest: Any) -> dict[str, Any]:
    return map_verl_section({"agentlightning": section, **rest})


def test_no_section_leaves_the_overrides_as_they_are() -> None:
    overrides = {"data": {"train_batch_size": 4}}
    assert map_verl_section(overrides) == overrides


def test_port_is_the_task_servers_port() -> None:
    assert _mapped({"port": 9999}) == {"aglverl": {"port": 9999, "signal": {"trajectory": "merge"}}}


def test_trace_aggregator_level_picks_the_row_layout() -> None:
    assert _mapped({"trace_aggregator": {"level": "transition"}}) == {"aglverl": {"signal": {"trajectory": "per_call"}}}
    assert _mapped({"trace_aggregator": {"level": "trajectory"}}) == {"aglverl": {"signal": {"trajectory": "merge"}}}
    merge = {"aglverl": {"signal": {"trajectory": "merge"}}}
    assert _mapped({"trace_aggregator": {}}) == merge  # left out: aglverl's default (merge)
    assert _mapped({"port": 1}, aglverl={"signal": {"trajectory": "per_call"}})["aglverl"]["signal"] == {
        "trajectory": "per_call"
    }


def test_trajectory_widths_are_the_merged_rows_widths_and_do_nothing_under_transition() -> None:
    widths = {"trajectory_max_prompt_length": 4096, "trajectory_max_response_length": 34384}
    assert _mapped({"trace_aggregator": {"level": "trajectory", **widths}}) == {
        "aglverl": {"signal": {"trajectory": "merge"}},
        "data": {"max_prompt_length": 4096, "max_response_length": 34384},
    }
    assert "data" not in _mapped({"trace_aggregator": {"level": "transition", **widths}})


def test_a_width_that_disagrees_with_verls_key_names_both() -> None:
    with pytest.raises(ConfigError, match=r"trajectory_max_prompt_length \(4096\) and data.max_prompt_length \(512\)"):
        _mapped({"trace_aggregator": {"trajectory_max_prompt_length": 4096}}, data={"max_prompt_length": 512})


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"prot": 1}, r"unknown config key 'agentlightning.prot'; did you mean 'port'"),
        ({"trace_aggregator": {"levle": "x"}}, r"'agentlightning.trace_aggregator.levle'; did you mean 'level'"),
        ({"port": "9999"}, r"agentlightning.port must be a port number"),
        ({"trace_aggregator": {"level": "turn"}}, r"level must be 'trajectory' or 'transition', got 'turn'"),
        ({"trace_aggregator": {"debug": True}}, r"debug: True cannot be honoured.*batch/n_calls_drifted"),
        ({"trace_aggregator": {"trajectory_max_prompt_length": 0}}, r"must be an integer >= 1, got 0"),
        ({"agl_base_url": "http://h:1"}, r"agentlightning.agl_base_url is a key of Agent Lightning 1.0's section"),
        ("port=1", r"agentlightning must be a mapping"),
    ],
)
def test_bad_keys_are_refused_naming_them(section: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _mapped(section)


def test_mismatch_log_dir_and_debug_false_are_accepted() -> None:
    assert _mapped({"trace_aggregator": {"debug": False, "mismatch_log_dir": "./m"}}) == {
        "aglverl": {"signal": {"trajectory": "merge"}}
    }


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
