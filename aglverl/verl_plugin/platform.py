"""A CPU device platform for verl, registered with ``verl.plugin.platform.PlatformRegistry`` as ``"cpu"``.

verl picks its device through that registry (``VERL_PLATFORM=cpu`` selects this one). Everything verl asks of
an accelerator has a CPU meaning here: the device is ``"cpu"``, collectives go over gloo, memory queries report
the host's memory, streams and profiling are no-ops. Ray still has to schedule verl's workers on "GPU" bundles
(every resource-pool bundle asks for one, ``single_controller/ray/base.py``), so the driver declares fake GPU
resources to Ray and this platform names ``"GPU"`` as its Ray resource.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

__all__ = ["CPU_PLATFORM", "CPUPlatform", "cpu_device_module"]

#: The name this platform is registered under (``VERL_PLATFORM``).
CPU_PLATFORM = "cpu"


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def _zero(*_args: Any, **_kwargs: Any) -> int:
    return 0


def _mem_get_info(*_args: Any) -> tuple[int, int]:
    memory = psutil.virtual_memory()
    return memory.available, memory.total


def _make_device_module() -> types.ModuleType:
    """``torch.cpu`` plus what verl calls on ``torch.cuda`` that ``torch.cpu`` lacks.

    verl calls ``get_torch_device().empty_cache()``, ``.mem_get_info()``, ``.get_rng_state()`` and friends
    unconditionally in places (e.g. ``engine_workers.update_weights``); ``torch.cpu`` has none of them.
    """
    module = types.ModuleType("aglverl_cpu_device", "torch.cpu with the torch.cuda calls verl makes.")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(module, name, getattr(torch.cpu, name))
    module.empty_cache = _noop  # type: ignore[attr-defined]
    module.ipc_collect = _noop  # type: ignore[attr-defined]
    module.reset_peak_memory_stats = _noop  # type: ignore[attr-defined]
    module.set_per_process_memory_fraction = _noop  # type: ignore[attr-defined]
    module.memory_allocated = _zero  # type: ignore[attr-defined]
    module.memory_reserved = _zero  # type: ignore[attr-defined]
    module.max_memory_allocated = _zero  # type: ignore[attr-defined]
    module.max_memory_reserved = _zero  # type: ignore[attr-defined]
    module.mem_get_info = _mem_get_info  # type: ignore[attr-defined]
    module.get_rng_state = torch.get_rng_state  # type: ignore[attr-defined]
    module.set_rng_state = torch.set_rng_state  # type: ignore[attr-defined]
    module.manual_seed = torch.manual_seed  # type: ignore[attr-defined]
    module.manual_seed_all = torch.manual_seed  # type: ignore[attr-defined]
    module.get_device_name = lambda *_args: "cpu"  # type: ignore[attr-defined]
    return module


cpu_device_module = _make_device_module()


@PlatformRegistry.register(platform=CPU_PLATFORM)
class CPUPlatform(PlatformBase):
    """verl's device abstraction on a machine (or a Ray worker) without an accelerator."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return cpu_device_module

    def is_available(self) -> bool:
        # "Is the accelerator usable?": no. verl then skips accelerator-only work (RNG state, offload).
        return False

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: the driver selects it explicitly (VERL_PLATFORM=cpu), so a GPU machine that
        # merely has aglverl installed keeps verl's own detection.
        return False

    def current_device(self) -> Any:
        # verl does ``tensor.to(get_device_id())`` (transformer_impl.py:730, 1028, 1552); an index would mean
        # a CUDA device, so the id must be the device string.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        # verl's resource pools put one accelerator in every bundle; the driver declares fake "GPU"s to Ray.
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
