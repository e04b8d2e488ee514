"""What verl's processes need for one run: the plugin environment, the CPU platform in the driver, a Ray of the
run's own (or the one ``RAY_ADDRESS`` names), worker groups that meet through a local rendezvous; and the
checkpoints verl will resume from."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, cast

from .validation import ConfigError

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- Ray
PLATFORM_ENV = {
    # verl/__init__.py:49 imports these in every process that imports verl: our platform and rollout.
    "VERL_USE_EXTERNAL_MODULES": "aglverl.verl_plugin",
    "VERL_PLATFORM": "cpu",
    # verl's fsdp engines are registered under cuda/npu only (workers/engine/fsdp/transformer_impl.py:1143);
    # this changes only the registry lookup key (workers/engine/base.py:405), not where tensors live.
    "VERL_ENGINE_DEVICE": "cuda",
}


def transfer_queue_threads_env() -> dict[str, str]:
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
    env.update(transfer_queue_threads_env())
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    from ..verl_plugin.patches import transfer_queue_threads

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
    from .. import verl_plugin

    if platform == "cpu":
        from verl.plugin.platform import get_platform, set_platform

        from ..verl_plugin.platform import CPUPlatform

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
        cast(
            Mapping[str, Any],
            OmegaConf.to_container(config.ray_kwargs.get("ray_init", {}), resolve=True) or {},
        )
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
    from ..verl_plugin.patches import loopback_only_ray

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


def total_steps(config: Any, n_train: int) -> int:
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


def latest_checkpoint(config: Any) -> tuple[int, str] | None:
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


def save_step_metrics(config: Any, step: int, metrics: Mapping[str, float]) -> None:
    """Keep the metrics of a step that saved a checkpoint beside it (a run resumed with nothing left to train
    returns them). Small and rare: written on the loop, between the step and the next."""
    if int(config.trainer.save_freq) <= 0:
        return
    folder = os.path.join(os.path.abspath(str(config.trainer.default_local_dir)), f"global_step_{step}")
    if os.path.isdir(folder):
        import orjson

        Path(folder, METRICS_FILE).write_bytes(orjson.dumps(dict(metrics), option=orjson.OPT_SERIALIZE_NUMPY))


def saved_step_metrics(checkpoint: str) -> dict[str, float]:
    """The metrics saved beside ``checkpoint`` (blocking); empty, with a line saying so, when there are none."""
    import orjson

    try:
        return dict(orjson.loads(Path(checkpoint, METRICS_FILE).read_bytes()))
    except (OSError, orjson.JSONDecodeError) as exc:
        logger.warning("aglverl: no metrics saved beside %s (%s); returning none", checkpoint, exc)
        return {}


#: How many task inputs :func:`check_prompt_widths` renders (spread over the dataset), and how much wider
#: than the longest of them verl's default ``max_prompt_length`` must be to be worth a line.


def worker_group_class(env: Mapping[str, str], rendezvous_dir: Path | None) -> type:
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


def journal_path(config: Any, journal: str | None) -> str | None:
    """The daemon's journal for this run (``aglverl.journal``): ``"auto"`` puts it next to verl's checkpoints
    when they are saved (none otherwise). Creates its directory, and removes a previous run's journal when
    ``trainer.resume_mode`` is ``disable`` (a fresh run must not recover another run's groups); blocking."""
    if journal == "auto":
        saves = int(config.trainer.save_freq) > 0
        journal = os.path.join(config.trainer.default_local_dir, "aglverl.journal") if saves else None
    if journal is not None:
        os.makedirs(os.path.dirname(os.path.abspath(journal)), exist_ok=True)
        if config.trainer.resume_mode == "disable" and os.path.exists(journal):
            os.remove(journal)
    return journal
