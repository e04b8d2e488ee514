"""AsyncVERL's config: user overrides merged onto verl's real ppo_trainer.yaml (Hydra), errors naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aglverl.algorithm import (
    CPU_DEFAULTS,
    AsyncVERL,
    ConfigError,
    DaemonOptions,
    compose_config,
    load_samples,
)
from aglverl.signals import SignalConfig
from aglverl.tiny import tiny_model_path

pytestmark = pytest.mark.usefixtures("tiny_model")

SMALL = {
    "data": {"train_batch_size": 4, "max_prompt_length": 64, "max_response_length": 16},
    "actor_rollout_ref": {"rollout": {"n": 4}, "actor": {"ppo_mini_batch_size": 2}},
    "algorithm": {"adv_estimator": "grpo"},
}


def test_overrides_are_merged_onto_verls_yaml_with_cpu_defaults() -> None:
    config, options = compose_config(
        {**SMALL, "actor_rollout_ref.actor.optim.lr": 1e-3, "trainer": {"total_training_steps": 7}}
    )
    assert config.data.train_batch_size == 4
    assert config.actor_rollout_ref.rollout.n == 4
    assert config.actor_rollout_ref.actor.optim.lr == 1e-3  # a dotted key, as on verl's command line
    assert config.trainer.total_training_steps == 7
    # untouched keys keep verl's packaged defaults
    assert config.actor_rollout_ref.actor.clip_ratio == 0.2
    assert config.algorithm.gamma == 1.0
    # the CPU platform's needs, applied because this machine has no GPU
    assert config.trainer.device == "cpu"
    assert config.actor_rollout_ref.rollout.name == "aglverl"
    assert config.actor_rollout_ref.actor.strategy == "fsdp2"
    assert config.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    # "tiny" is the locally built model; the critic defaults to the actor's model
    assert Path(config.actor_rollout_ref.model.path) == tiny_model_path()
    assert config.critic.model.path == config.actor_rollout_ref.model.path
    # interpolations are resolved (the rollout reads the data lengths)
    assert config.actor_rollout_ref.rollout.response_length == 16
    # verl computes the engine's log-probs by default (rollout.calculate_log_probs): the proxy asks for them
    assert options == DaemonOptions(signal=SignalConfig(request_logprobs=True))


def test_user_overrides_beat_the_cpu_defaults() -> None:
    config, _ = compose_config({**SMALL, "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16"})
    assert CPU_DEFAULTS["actor_rollout_ref"]["actor"]["fsdp_config"]["dtype"] == "float32"
    assert config.actor_rollout_ref.actor.fsdp_config.dtype == "bfloat16"


def test_rollout_name_vllm_alone_selects_verls_vllm_rollout_with_its_cpu_defaults() -> None:
    from aglverl.algorithm import VLLM_CPU_ROLLOUT

    config, _ = compose_config(
        {"actor_rollout_ref.rollout.name": "vllm", "data.max_prompt_length": 64, "data.max_response_length": 32}
    )
    rollout = config.actor_rollout_ref.rollout
    assert rollout.name == "vllm" and rollout.mode == "async" and rollout.dtype == "float32"
    assert {key: rollout[key] for key in VLLM_CPU_ROLLOUT if key != "max_model_len"} == {
        key: value for key, value in VLLM_CPU_ROLLOUT.items() if key != "max_model_len"
    }
    assert rollout.max_model_len == 96  # the rollout's prompt + response
    # each of them the user's where given
    config, _ = compose_config(
        {"actor_rollout_ref.rollout": {"name": "vllm", "max_num_seqs": 3, "max_model_len": 512}}
    )
    assert (config.actor_rollout_ref.rollout.max_num_seqs, config.actor_rollout_ref.rollout.max_model_len) == (3, 512)
    # the embedded engine's config is untouched by them
    embedded, _ = compose_config({})
    assert embedded.actor_rollout_ref.rollout.max_num_seqs == 256


def test_verls_vllm_rollout_serves_the_token_in_endpoints_unless_the_user_says_otherwise() -> None:
    config, options = compose_config({"actor_rollout_ref.rollout.name": "vllm"})
    assert config.actor_rollout_ref.rollout.engine_kwargs.vllm.enable_scale_out is True  # --enable_scale_out
    assert options.token_in is True
    config, options = compose_config(
        {"actor_rollout_ref.rollout": {"name": "vllm", "engine_kwargs": {"vllm": {"enable_scale_out": False}}}, "aglverl.token_in": False}
    )
    assert config.actor_rollout_ref.rollout.engine_kwargs.vllm.enable_scale_out is False and not options.token_in
    embedded, _ = compose_config({})
    assert "enable_scale_out" not in embedded.actor_rollout_ref.rollout.engine_kwargs.vllm


def test_aglverl_section_configures_the_daemon() -> None:
    _, options = compose_config(
        {**SMALL, "aglverl": {"max_attempts": 5, "llm_resource": "plain", "agents": 3, "journal": None}}
    )
    assert options.max_attempts == 5
    assert options.llm_resource == "plain"
    assert options.agents == 3
    assert options.journal is None


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"algorithm": {"adv_estimatr": "grpo"}}, "'algorithm.adv_estimatr'; did you mean 'adv_estimator'"),
        ({"trainer.totl_epochs": 1}, "'trainer.totl_epochs'"),
        ({"nonsense": {"a": 1}}, "'nonsense'"),
        ({"aglverl": {"prot": 1}}, "'aglverl.prot'; did you mean 'port'"),
        ({"aglverl": {"llm_resource": "fancy"}}, "aglverl.llm_resource"),
        ({"aglverl": {"agents": 0}}, "aglverl.agents"),
        ({"aglverl": {"max_failed_groups": -1}}, "aglverl.max_failed_groups"),
        ({"aglverl": {"hold_timeout": 0}}, "aglverl.hold_timeout"),
    ],
)
def test_unknown_keys_and_bad_values_are_errors_naming_the_key(overrides: dict, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config({**SMALL, **overrides})
    assert named in str(info.value)


def test_failed_groups_are_refilled_in_sync_mode_unless_the_user_says_otherwise() -> None:
    config, options = compose_config(SMALL)
    assert config.trainer.v1.sampler.sync_refill_failed_groups is True
    assert options.max_failed_groups is None and options.hold_timeout == 4 * 3600.0
    config, _ = compose_config({**SMALL, "trainer.v1.sampler.sync_refill_failed_groups": False})
    assert config.trainer.v1.sampler.sync_refill_failed_groups is False


def test_free_form_mappings_accept_any_key() -> None:
    config, _ = compose_config({**SMALL, "actor_rollout_ref.model.override_config.rope_theta": 5000.0})
    assert config.actor_rollout_ref.model.override_config.rope_theta == 5000.0


def test_dataclass_fields_the_yaml_leaves_out_are_accepted() -> None:
    # FSDPEngineConfig.mixed_precision is not in ppo_trainer.yaml (verl's CLI adds it with "+")
    config, _ = compose_config({**SMALL, "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": "bf16"})
    assert config.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "bf16"
    assert config.actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype == "fp32"  # CPU default kept
    with pytest.raises(ConfigError, match=r"fsdp_config\.mixed_precison.*did you mean .mixed_precision."):
        compose_config({**SMALL, "actor_rollout_ref.actor.fsdp_config.mixed_precison": {}})


def test_algorithms_that_need_the_trainer_to_generate_are_refused() -> None:
    with pytest.raises(ConfigError, match="remax"):
        compose_config({**SMALL, "algorithm": {"adv_estimator": "remax"}})


def test_the_config_feeds_verls_v1_trainer_with_aglverls_sampler() -> None:
    config, _ = compose_config(SMALL)
    assert config.trainer.use_v1 is True  # verl's default, and aglverl's
    sampler = config.trainer.v1.sampler.custom_sampler
    assert (sampler.path, sampler.name) == ("pkg://aglverl.verl_v1", "EventReplayBuffer")
    config, _ = compose_config({**SMALL, "trainer.v1.trainer_mode": "colocate_async"})
    assert config.trainer.v1.sampler.custom_sampler.name == "EventReplayBufferAsync"
    # verl's packaged gsm8k paths mean nothing for agents: unset unless the user names files
    assert config.data.train_files is None and config.data.val_files is None
    with pytest.raises(ConfigError, match="use_v1=false"):
        compose_config({**SMALL, "trainer.use_v1": False})


def test_behaviour_log_probs_are_one_setting_for_verl_and_the_proxy() -> None:
    config, options = compose_config({**SMALL, "actor_rollout_ref.rollout.calculate_log_probs": False})
    assert config.actor_rollout_ref.rollout.calculate_log_probs is False
    assert options.signal.request_logprobs is False
    config, options = compose_config(
        {**SMALL, "actor_rollout_ref.rollout.calculate_log_probs": False, "aglverl.signal.request_logprobs": True}
    )
    assert config.actor_rollout_ref.rollout.calculate_log_probs is True
    assert options.signal.request_logprobs is True


def test_rejection_sampling_is_verls_group_filter_with_a_bound() -> None:
    config, options = compose_config({**SMALL, "aglverl.signal.rejection_sampling": True})
    groups = config.algorithm.filter_groups
    assert (groups.enable, groups.metric, groups.max_num_gen_batches) == (True, "reward", 4)
    assert options.signal.rejection_sampling
    config, _ = compose_config(
        {**SMALL, "aglverl.signal.rejection_sampling": True, "algorithm.filter_groups.max_num_gen_batches": 2}
    )
    assert config.algorithm.filter_groups.max_num_gen_batches == 2


def test_sampling_mismatch_rule_is_checked() -> None:
    _, options = compose_config({**SMALL, "aglverl": {"sampling_mismatch": "mask"}})
    assert options.sampling_mismatch == "mask"
    with pytest.raises(ConfigError, match=r"aglverl\.sampling_mismatch"):
        compose_config({**SMALL, "aglverl": {"sampling_mismatch": "ignore"}})


def test_verls_own_validation_runs() -> None:
    with pytest.raises(ConfigError, match="verl rejected the config: Invalid loss_agg_mode"):
        compose_config({**SMALL, "actor_rollout_ref.actor.loss_agg_mode": "bogus"})


def test_model_paths_tiny_is_built_locally_and_a_missing_directory_is_named(tmp_path: Path) -> None:
    config, _ = compose_config({**SMALL, "actor_rollout_ref.model.path": str(tiny_model_path())})
    assert config.actor_rollout_ref.model.path == str(tiny_model_path())
    missing = str(tmp_path / "no-model")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.path: .*no-model.* is not a directory"):
        AsyncVERL({**SMALL, "actor_rollout_ref.model.path": missing})


def test_samples_load_from_lists_jsonl_and_parquet(tmp_path: Path) -> None:
    rows = [{"q": "a", "n": 1}, {"q": "b", "n": 2}]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    assert load_samples(rows) == rows
    assert load_samples(str(jsonl)) == rows
    assert load_samples(parquet) == rows
    assert load_samples(None, [str(jsonl), str(parquet)]) == rows + rows
    assert load_samples(None, None) is None
    with pytest.raises(ConfigError, match="does not exist"):
        load_samples(str(tmp_path / "missing.parquet"))
    with pytest.raises(ConfigError, match=r"expected \.parquet"):
        load_samples(str(tmp_path))
    with pytest.raises(ConfigError, match="row 1 must be a mapping"):
        load_samples([{"q": 1}, "text"])  # type: ignore[list-item]
