"""AsyncVERL's config: user overrides merged onto verl's real ppo_trainer.yaml (Hydra), errors naming the key."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
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
from aglverl.algorithm.config import daemon_config, script_name
from aglverl.algorithm.samples import check_prompt_widths
from aglverl.engine.tiny import tiny_model_path
from aglverl.trajectory.signals import SignalConfig

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


def test_rollout_engine_that_cannot_be_imported_is_refused_at_construction_naming_the_key_and_the_fix() -> (
    None
):
    """``rollout.name: sglang`` (and ``vllm`` where vLLM is not installed) is refused when ``AsyncVERL`` is
    constructed, before Ray starts, naming the key, what to install and the embedded engine's two ways in."""
    import importlib.util

    engines = [("sglang", "SGLang", "sglang")]
    if importlib.util.find_spec("vllm") is None:
        engines.append(("vllm", "vLLM", "make venv-vllm"))
    for name, label, install in engines:
        with pytest.raises(ConfigError) as refused:
            AsyncVERL({**SMALL, "actor_rollout_ref.rollout.name": name})
        message = str(refused.value)
        assert message.startswith(f"actor_rollout_ref.rollout.name: {name} needs {label}")
        assert install in message and "actor_rollout_ref.rollout.name: aglverl" in message
        assert "aglverl fit --rollout embedded SCRIPT" in message
    AsyncVERL({**SMALL, "actor_rollout_ref.rollout.name": "aglverl"})  # the embedded engine needs nothing


def test_rollout_name_vllm_alone_selects_verls_vllm_rollout_with_its_cpu_defaults() -> None:
    from aglverl.algorithm import VLLM_CPU_ROLLOUT

    config, _ = compose_config(
        {
            "actor_rollout_ref.rollout.name": "vllm",
            "data.max_prompt_length": 64,
            "data.max_response_length": 32,
        }
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
    assert (
        config.actor_rollout_ref.rollout.max_num_seqs,
        config.actor_rollout_ref.rollout.max_model_len,
    ) == (3, 512)
    # the embedded engine's config is untouched by them
    embedded, _ = compose_config({})
    assert embedded.actor_rollout_ref.rollout.max_num_seqs == 256


def test_verls_vllm_rollout_serves_the_token_in_endpoints_unless_the_user_says_otherwise() -> None:
    config, options = compose_config({"actor_rollout_ref.rollout.name": "vllm"})
    assert config.actor_rollout_ref.rollout.engine_kwargs.vllm.enable_scale_out is True  # --enable_scale_out
    assert options.token_in is True
    config, options = compose_config(
        {
            "actor_rollout_ref.rollout": {
                "name": "vllm",
                "engine_kwargs": {"vllm": {"enable_scale_out": False}},
            },
            "aglverl.token_in": False,
        }
    )
    assert (
        config.actor_rollout_ref.rollout.engine_kwargs.vllm.enable_scale_out is False and not options.token_in
    )
    embedded, _ = compose_config({})
    assert "enable_scale_out" not in embedded.actor_rollout_ref.rollout.engine_kwargs.vllm


def test_verls_vllm_rollout_gets_the_tool_call_parser_of_the_models_family() -> None:
    # the tiny model is a qwen2 with a Hermes template: vllm serve ... --enable_auto_tool_choice --tool_call_parser hermes
    config, options = compose_config({"actor_rollout_ref.rollout.name": "vllm"})
    vllm = config.actor_rollout_ref.rollout.engine_kwargs.vllm
    assert options.tool_call_parser == "auto"
    assert (vllm.enable_auto_tool_choice, vllm.tool_call_parser) == (True, "hermes")
    # a name forces one, null leaves vLLM without tool calling, the user's engine arguments win
    config, _ = compose_config(
        {"actor_rollout_ref.rollout.name": "vllm", "aglverl.tool_call_parser": "qwen3_json"}
    )
    assert config.actor_rollout_ref.rollout.engine_kwargs.vllm.tool_call_parser == "qwen3_json"
    config, _ = compose_config({"actor_rollout_ref.rollout.name": "vllm", "aglverl.tool_call_parser": None})
    assert "tool_call_parser" not in config.actor_rollout_ref.rollout.engine_kwargs.vllm
    assert "enable_auto_tool_choice" not in config.actor_rollout_ref.rollout.engine_kwargs.vllm
    config, _ = compose_config(
        {
            "actor_rollout_ref.rollout": {
                "name": "vllm",
                "engine_kwargs": {"vllm": {"tool_call_parser": "my_plugin"}},
            }
        }
    )
    vllm = config.actor_rollout_ref.rollout.engine_kwargs.vllm
    assert (vllm.enable_auto_tool_choice, vllm.tool_call_parser) == (True, "my_plugin")
    embedded, _ = compose_config({})
    assert "tool_call_parser" not in embedded.actor_rollout_ref.rollout.engine_kwargs.vllm


@pytest.mark.parametrize(
    ("files", "parser"),
    [
        ({"config.json": {"model_type": "qwen3"}}, "hermes"),
        ({"config.json": {"model_type": "llama", "vocab_size": 128256}}, "llama3_json"),
        ({"config.json": {"model_type": "llama", "vocab_size": 32000}}, None),
        # Hermes 3 on Llama 3.1: the template's <tool_call> blocks, not Llama's JSON
        (
            {
                "config.json": {"model_type": "llama", "vocab_size": 128256},
                "chat_template.jinja": "<tool_call>",
            },
            "hermes",
        ),
        ({"config.json": {"model_type": "mistral"}}, "mistral"),
        (
            {"config.json": {"model_type": "qwen3_moe"}, "chat_template.jinja": "<tool_call>\n<function="},
            "qwen3_coder",
        ),
        (
            {"config.json": {"model_type": "phi"}, "tokenizer_config.json": {"chat_template": "<tool_call>"}},
            "hermes",
        ),
        ({"config.json": {"model_type": "phi"}}, None),
        ({}, None),
    ],
)
def test_the_tool_call_parser_is_picked_from_the_models_files(
    tmp_path: Path, files: dict, parser: str | None
) -> None:
    from aglverl.algorithm.vllm_tools import KNOWN_TOOL_PARSERS, known_tool_parsers, pick_tool_call_parser

    for name, content in files.items():
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    assert pick_tool_call_parser(str(tmp_path))[0] == parser
    assert {"hermes", "llama3_json", "mistral", "qwen3_coder"} <= set(known_tool_parsers()) & set(
        KNOWN_TOOL_PARSERS
    )


@pytest.mark.parametrize(
    ("name", "parser"),
    [
        ("Qwen/Qwen2.5-1.5B-Instruct", "hermes"),
        ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3_coder"),
        ("meta-llama/Llama-3.1-8B-Instruct", "llama3_json"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "mistral"),
        ("google/gemma-2-2b-it", None),
    ],
)
def test_a_hub_name_not_in_the_local_cache_is_read_by_its_name(
    name: str, parser: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    from aglverl.algorithm.vllm_tools import pick_tool_call_parser

    monkeypatch.setattr(
        constants, "HF_HUB_CACHE", str(tmp_path)
    )  # an empty hub cache: no file of the model here
    monkeypatch.chdir(tmp_path)
    assert pick_tool_call_parser(name)[0] == parser


def test_aglverl_section_configures_the_daemon() -> None:
    _, options = compose_config(
        {
            **SMALL,
            "aglverl": {
                "max_attempts": 5,
                "llm_resource": "plain",
                "agents": 3,
                "journal": None,
                "proxy_shards": "per_node",
            },
        }
    )
    assert options.max_attempts == 5
    assert options.llm_resource == "plain"
    assert options.agents == 3
    assert options.journal is None
    assert options.proxy_shards == "per_node"


def test_the_aglverl_section_becomes_the_daemons_settings_each_in_the_part_that_uses_it() -> None:
    section = {
        "hold_timeout": 60.0,
        "lease_seconds": 30.0,
        "max_attempts": 2,
        "token": "t",
        "journal": None,
        "sampling_mismatch": "mask",
        "token_in": False,
        "signal": {"request_logprobs": True},
    }
    config, options = compose_config({**SMALL, "aglverl": section})
    settings = daemon_config(config, options)
    proxy = settings.proxy
    assert (proxy.hold_timeout, proxy.pause_timeout, proxy.sampling_mismatch, proxy.token_in) == (
        60.0,
        600.0,
        "mask",
        False,
    )
    assert (
        proxy.token == settings.token == "t" and proxy.request_logprobs and settings.signal is options.signal
    )
    assert (settings.store.lease_seconds, settings.store.max_attempts, settings.store.vocab_size) == (
        30.0,
        2,
        None,
    )
    assert (settings.batch.max_prompt_length, settings.batch.max_response_length) == (64, 16)
    assert settings.max_failed_groups == 4  # default: a batch's worth (data.train_batch_size)
    assert settings.journal_path is None and settings.backends == ()  # the trainer's part is filled in later


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"algorithm": {"adv_estimatr": "grpo"}}, "'algorithm.adv_estimatr'; did you mean 'adv_estimator'"),
        ({"trainer.totl_epochs": 1}, "'trainer.totl_epochs'"),
        ({"nonsense": {"a": 1}}, "'nonsense'"),
        ({"aglverl": {"prot": 1}}, "'aglverl.prot'; did you mean 'port'"),
        ({"aglverl": {"llm_resource": "fancy"}}, "aglverl.llm_resource"),
        ({"aglverl": {"agents": -1}}, "aglverl.agents"),
        ({"aglverl": {"max_failed_groups": -1}}, "aglverl.max_failed_groups"),
        ({"aglverl": {"hold_timeout": 0}}, "aglverl.hold_timeout"),
    ],
)
def test_unknown_keys_and_bad_values_are_errors_naming_the_key(overrides: dict, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config({**SMALL, **overrides})
    assert named in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"data": {"train_batch_size": "sixteen"}},
            "data.train_batch_size must be an integer, got 'sixteen' (str)",
        ),
        ({"aglverl": {"agents": "many"}}, "aglverl.agents must be an integer or null, got 'many' (str)"),
        (
            {"algorithm": {"adv_estimator": "grpoo"}},
            "algorithm.adv_estimator: 'grpoo' is not one of verl's advantage estimators (gae, gdpo, gpg, grpo,",
        ),
        (
            {"algorithm": {"adv_estimator": "grpoo"}},
            "rloo_vectorized, tir_optimal_token_baseline); did you mean 'grpo'?",
        ),
        (
            {"actor_rollout_ref.rollout.n": 0},
            "actor_rollout_ref.rollout.n must be an integer >= 1, got 0 (int)",
        ),
        (
            {"actor_rollout_ref.rollout.top_p": 1.5},
            "actor_rollout_ref.rollout.top_p must be a number > 0 and <= 1, got 1.5",
        ),
        (
            {"actor_rollout_ref.actor.ppo_epochs": 1.5},
            "actor_rollout_ref.actor.ppo_epochs must be an integer, got 1.5",
        ),
        (
            {"actor_rollout_ref.actor.optim.lr": "1e-3"},
            "actor_rollout_ref.actor.optim.lr must be a number, got '1e-3'",
        ),
        (
            {"actor_rollout_ref.actor.use_kl_loss": "yes"},
            "actor_rollout_ref.actor.use_kl_loss must be true or false",
        ),
        (
            {"trainer.v1.trainer_mode": "fast"},
            "trainer.v1.trainer_mode: 'fast' is not one of verl's V1 trainer modes (colocate_async, separate_async, sync)",
        ),
        (
            {"trainer.logger": ["console", "tensorbord"]},
            "'tensorbord' is not one of verl's logger backends (",
        ),
        ({"trainer.logger": ["console", "tensorbord"]}, "did you mean 'tensorboard'?"),
        (
            {"actor_rollout_ref.actor.policy_loss.loss_mode": "vanila"},
            "actor_rollout_ref.actor.policy_loss.loss_mode: 'vanila' is not one of verl's policy losses (",
        ),
        (
            {"actor_rollout_ref.rollout.name": "vllmm"},
            "'vllmm' is not one of the rollout engines (aglverl, sglang,",
        ),
        (
            {"trainer.resume_mode": "yes"},
            "trainer.resume_mode: 'yes' is not one of verl's resume modes (auto, disable",
        ),
        (
            {"trainer.total_training_steps": 0},
            "trainer.total_training_steps must be an integer >= 1 (or null), got 0",
        ),
        ({"data": 5}, "data must be a mapping, got 5 (int)"),
        ({"aglverl": "many"}, "the aglverl section must be a mapping of its options, got 'many'"),
        ({"aglverl": {"lease_seconds": -1}}, "aglverl.lease_seconds must be > 0, got -1"),
        ({"aglverl": {"port": 70000}}, "aglverl.port must be >= 0 and <= 65535, got 70000"),
        (
            {"aglverl": {"platform": "tpu"}},
            "aglverl.platform must be one of 'auto', 'cpu', 'gpu', got 'tpu' (str)",
        ),
        ({"aglverl": {"token": 123}}, "aglverl.token must be a string or null, got 123 (int)"),
        ({"aglverl": {"signal": "strict"}}, "aglverl.signal must be a mapping of SignalConfig's fields"),
        (
            {"aglverl": {"proxy_shards": 0}},
            "aglverl.proxy_shards must be an integer >= 1 or 'per_node', got 0",
        ),
        (
            {"aglverl": {"proxy_shards": "per-node"}},
            "aglverl.proxy_shards must be an integer or one of 'per_node', got 'per-node' (str)",
        ),
        (
            {"aglverl": {"tool_call_parser": 1}},
            "aglverl.tool_call_parser must be a string or null, got 1 (int)",
        ),
        (
            {"aglverl": {"tool_call_parser": "hermess"}},
            "aglverl.tool_call_parser: 'hermess' is not 'auto', null or one of vLLM's tool parsers (",
        ),
        ({"aglverl": {"tool_call_parser": "hermess"}}, ", hermes, "),
        ({"aglverl": {"tool_call_parser": "hermess"}}, ", llama3_json, "),
        ({"aglverl": {"tool_call_parser": "hermess"}}, "); did you mean 'hermes'?"),
        (
            {"actor_rollout_ref.actor.ppo_mini_batch_size": 8},
            "actor_rollout_ref.actor.ppo_mini_batch_size (8) is larger than data.train_batch_size (4): verl would "
            "pad every step with rows of no loss up to a whole mini-batch (2x the work); set it to at most 4",
        ),
    ],
)
def test_a_value_of_the_wrong_type_or_range_is_refused_at_construction_naming_key_value_and_choices(
    overrides: dict, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        AsyncVERL({**SMALL, **overrides})
    assert message in str(info.value)


def test_verls_mini_batch_default_larger_than_the_batch_becomes_the_batch_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aglverl.algorithm")
    overrides = {"data": {"train_batch_size": 16, "max_prompt_length": 64}, "actor_rollout_ref.rollout.n": 8}
    config, _ = compose_config(overrides)
    assert config.actor_rollout_ref.actor.ppo_mini_batch_size == 16
    assert config.critic.ppo_mini_batch_size == 16  # verl's critic follows the actor's
    lines = [record.getMessage() for record in caplog.records]
    assert any(
        "set actor_rollout_ref.actor.ppo_mini_batch_size = 16: verl's default (256) is larger than "
        "data.train_batch_size (16)" in line
        for line in lines
    ), lines
    # verl's default answer width on CPUs: a warning, no change (the task decides)
    assert any("data.max_response_length is verl's default (512)" in line for line in lines), lines
    assert config.data.max_response_length == 512
    caplog.clear()
    config, _ = compose_config({**overrides, "actor_rollout_ref.actor.ppo_mini_batch_size": 6})
    assert config.actor_rollout_ref.actor.ppo_mini_batch_size == 6  # the user's, never changed
    assert any(
        "not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size (6)" in r.getMessage()
        for r in caplog.records
    )


def test_a_run_is_named_after_its_script_so_its_checkpoints_are_its_own() -> None:
    config, _ = compose_config(SMALL)
    assert (config.trainer.project_name, config.trainer.experiment_name) == ("aglverl", script_name())
    assert config.trainer.default_local_dir == f"checkpoints/aglverl/{script_name()}"
    config, _ = compose_config({**SMALL, "trainer": {"project_name": "p", "experiment_name": "e"}})
    assert config.trainer.default_local_dir == "checkpoints/p/e"


def test_the_agent_is_checked_at_construction() -> None:
    def plain(task: dict, llm: object) -> float:
        return 1.0

    async def no_llm(task: dict) -> float:
        return 1.0

    with pytest.raises(TypeError, match=r"agent 'plain' is a plain function.*make it `async def plain"):
        AsyncVERL(SMALL, agent=plain)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"agent 'no_llm' must take two positional arguments \(task_input, llm\)"
    ):
        AsyncVERL(SMALL, agent=no_llm)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_data_that_cannot_fill_a_batch_is_refused_before_anything_starts() -> None:
    with pytest.raises(
        ConfigError, match=r"the training dataset has 3 tasks, fewer than data.train_batch_size \(4\)"
    ):
        await AsyncVERL(SMALL).run([{"prompt": "Say yes."}] * 3)


@pytest.mark.anyio
async def test_a_finished_run_started_again_says_so_and_returns_its_saved_metrics(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """verl's checkpoint of the last step, with the metrics aglverl keeps beside it: nothing starts (no Ray)."""
    folder = tmp_path / "ckpt"
    (folder / "global_step_3").mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text("3")
    (folder / "global_step_3" / "aglverl_metrics.json").write_text(json.dumps({"training/reward": 0.75}))
    caplog.set_level(logging.WARNING, logger="aglverl.algorithm")
    overrides = {**SMALL, "trainer": {"total_training_steps": 3, "default_local_dir": str(folder)}}
    assert await AsyncVERL(overrides).run([{"prompt": "Say yes."}] * 4) == {"training/reward": 0.75}
    assert f"nothing left to train: the checkpoint {folder / 'global_step_3'} is step 3 of 3" in caplog.text


def test_prompts_the_tasks_carry_are_measured_against_the_width() -> None:
    config, _ = compose_config(SMALL)  # max_prompt_length 64
    long_prompt = [{"prompt": "word " * 100}, {"prompt": [{"role": "user", "content": "Say yes."}]}]
    logger = logging.getLogger("aglverl.algorithm")
    with _records(logger) as records:
        check_prompt_widths(config, True, long_prompt)
    assert (
        len(records) == 1
        and "1 of 2 prompts measured are longer than data.max_prompt_length (64" in records[0]
    )
    wide, _ = compose_config({**SMALL, "data": {"train_batch_size": 4, "max_response_length": 16}})
    with _records(logger) as records:
        check_prompt_widths(wide, False, [{"prompt": "Say yes."}])  # verl's 512 for a ~20-token prompt
    assert len(records) == 1 and "data.max_prompt_length is verl's default (512)" in records[0]
    with _records(logger) as records:
        check_prompt_widths(wide, True, [{"prompt": "Say yes."}])  # the user's own width: not second-guessed
        check_prompt_widths(wide, False, [{"question": "no prompt here"}])  # the agent builds its prompt
    assert records == []


@contextmanager
def _records(logger: logging.Logger) -> Iterator[list[str]]:
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


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
    config, _ = compose_config(
        {**SMALL, "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": "bf16"}
    )
    assert config.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "bf16"
    assert (
        config.actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype == "fp32"
    )  # CPU default kept
    with pytest.raises(ConfigError, match=r"fsdp_config\.mixed_precison.*did you mean .mixed_precision."):
        compose_config({**SMALL, "actor_rollout_ref.actor.fsdp_config.mixed_precison": {}})


def test_dataset_files_are_one_path_or_a_list_of_paths_as_verl_takes_them(tmp_path: Path) -> None:
    """``data.train_files`` / ``val_files`` take a list of paths as verl's dataset does (they were refused as
    "must be a string" by the type of verl's default), and the task inputs come from every file; the keys that
    verl opens as one path stay one path."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text('{"q": 1}\n{"q": 2}\n')
    second.write_text('{"q": 3}\n')
    config, _ = compose_config(
        {
            **SMALL,
            "data.train_files": [str(first), second],
            "data.val_files": [second],
            "trainer.logger": ("console",),
        }
    )
    assert list(config.data.train_files) == [str(first), str(second)]
    assert [row["q"] for row in load_samples(None, config.data.train_files)] == [1, 2, 3]
    assert [row["q"] for row in load_samples(None, config.data.val_files)] == [3]
    refused = [
        (
            {"data.train_files": 5},
            "data.train_files must be a string or a list of strings or null, got 5 (int)",
        ),
        ({"data.val_files": [str(first), 7]}, "data.val_files must be a string or a list of strings or null"),
        ({"data.custom_cls": {"path": ["x.py"]}}, "data.custom_cls.path must be a string or null"),
        ({"data.custom_cls": "x.py"}, "data.custom_cls must be a mapping"),
        ({"trainer.rollout_data_dir": ["a", "b"]}, "trainer.rollout_data_dir must be a string or null"),
        ({"actor_rollout_ref.model.path": ["a", "b"]}, "actor_rollout_ref.model.path must be a string"),
        ({"trainer.logger": 3}, "trainer.logger must be a string or a list of strings, got 3 (int)"),
    ]
    for overrides, message in refused:
        with pytest.raises(ConfigError) as info:
            compose_config({**SMALL, **overrides})
        assert message in str(info.value), str(info.value)


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
        {
            **SMALL,
            "actor_rollout_ref.rollout.calculate_log_probs": False,
            "aglverl.signal.request_logprobs": True,
        }
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


def test_the_aglverl_proxy_section_is_read_whole_into_the_proxys_config_the_old_flat_keys_as_aliases() -> (
    None
):
    section = {
        "pause_timeout": 30.0,
        "max_body_bytes": 1 << 20,
        "request_timeout": 120.0,
        "retry": {"attempts": 5},
        "overload": {"max_lag": 0.2, "refuse": False},
        "token_in": False,
    }
    config, options = compose_config({**SMALL, "aglverl": {"token": "t", "proxy": section}})
    proxy = daemon_config(config, options).proxy
    assert (proxy.pause_timeout, proxy.max_body_bytes, proxy.request_timeout) == (30.0, 1 << 20, 120.0)
    assert (proxy.retry.attempts, proxy.overload.max_lag, proxy.overload.refuse) == (5, 0.2, False)
    assert proxy.token == "t" and not proxy.token_in and not options.token_in
    assert proxy.hold_timeout == 4 * 3600.0  # a run's default, not pause_timeout
    _, dotted = compose_config({**SMALL, "aglverl.proxy.max_request_bytes": 10, "aglverl.proxy_port": 8123})
    assert (dotted.proxy.max_body_bytes, dotted.proxy.port, dotted.proxy_port) == (10, 8123, 8123)
    for overrides, message in [
        (
            {"aglverl": {"hold_timeout": 5, "proxy": {"hold_timeout": 6}}},
            "aglverl.hold_timeout is the old name",
        ),
        ({"aglverl.proxy.pause_timout": 1}, "'aglverl.proxy.pause_timout'; did you mean 'pause_timeout'"),
        ({"aglverl.proxy.max_body_bytes": "big"}, "aglverl.proxy.max_body_bytes must be an integer"),
        ({"aglverl.proxy.pause_timeout": 0}, "aglverl.proxy.pause_timeout must be > 0, got 0"),
        (
            {"aglverl.proxy.retry.atempts": 2},
            "unknown proxy setting 'retry.atempts'; did you mean 'attempts'",
        ),
        ({"aglverl.proxy_port": 70000}, "aglverl.proxy_port must be >= 0 and <= 65535, got 70000"),
        ({"aglverl.proxy": 3}, "aglverl.proxy must be a mapping of the proxy's settings"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            compose_config({**SMALL, **overrides})
