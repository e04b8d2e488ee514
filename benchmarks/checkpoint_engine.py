"""Weight sync on CPU: seconds per sync by transport and weight-set size. Prints one JSON object.

A sync moves a set of named CPU tensors from a "trainer" Ray actor to a "rollout" Ray actor (two processes on
this node, Ray on loopback) and ends when the rollout holds its own copy of every tensor, as the embedded
rollout does before loading them. Transports:

- ``object_store``: aglverl's shipped engine (``aglverl.verl_plugin.checkpoint``, backend ``aglverl_cpu``, verl's
  default 2048 MB buckets), driven as verl's ``CheckpointEngineManager`` drives it: prepare, build_topology,
  init_process_group, send_weights and receive_weights at once, finalize. Each sync pays all of it (any engine
  does under verl's manager); ``transfer_median_s`` is its send/receive phase alone, comparable to the others.
- ``gloo``: a gloo process group between the two (a TCP store and gloo's pairs on 127.0.0.1), built once
  before the syncs as verl's NCCL engine keeps its group; one broadcast per tensor into fresh tensors.
- ``shared_memory``: the trainer copies the tensors into a new ``/dev/shm`` file per sync, the rollout maps it
  and copies each tensor out, the trainer unlinks it at the end of the sync.

Weight sets: ``tiny`` (the built-in tiny Qwen2's state dict, ~0.5 M parameters) and synthetic fp32 sets laid
out like a transformer's (per layer 4 square and 3 wide matrices plus 2 norms, hidden 1024) of about 100 MB
and 1 GB. Each (transport, size) runs one untimed cold sync (``first_s``: first touch of fresh memory, Ray's
object store included) and then ``--repeats`` timed ones (median, min, max).

    .venv/bin/python benchmarks/checkpoint_engine.py                 # ~3 min; all sizes
    .venv/bin/python benchmarks/checkpoint_engine.py --sizes tiny 100MB --repeats 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import machine_info

from aglverl.verl_plugin.checkpoint import ObjectStoreCheckpointEngine
from aglverl.verl_plugin.patches import loopback_only_ray

SIZES = ("tiny", "100MB", "1GB")
TRANSPORTS = ("object_store", "gloo", "shared_memory")
#: Bound on every Ray call of the benchmark: a transport that hangs fails the run instead of stalling it.
CALL_TIMEOUT = 600.0


# ---------------------------------------------------------------------------------------------- weight sets
def tiny_weights() -> list[tuple[str, torch.Tensor]]:
    """The built-in tiny model's state dict (tied embeddings appear under both names, as verl yields them)."""
    from transformers import AutoModelForCausalLM

    from aglverl.engine.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as scratch:
        model = AutoModelForCausalLM.from_pretrained(build_tiny_model(scratch))
    return [(name, tensor.detach().contiguous()) for name, tensor in model.state_dict().items()]


def synthetic_weights(total_bytes: int, hidden: int = 1024) -> list[tuple[str, torch.Tensor]]:
    """About ``total_bytes`` of fp32 tensors in a transformer's shapes (layers until the budget is spent)."""
    wide = hidden * 8 // 3
    layer = [
        ("q", (hidden, hidden)),
        ("k", (hidden, hidden)),
        ("v", (hidden, hidden)),
        ("o", (hidden, hidden)),
    ]
    layer += [("gate", (wide, hidden)), ("up", (wide, hidden)), ("down", (hidden, wide))]
    layer += [("input_norm", (hidden,)), ("post_norm", (hidden,))]
    per_layer = sum(torch.Size(shape).numel() * 4 for _, shape in layer)
    generator = torch.Generator().manual_seed(0)
    out = []
    for index in range(max(1, round(total_bytes / per_layer))):
        for name, shape in layer:
            out.append((f"model.layers.{index}.{name}.weight", torch.randn(shape, generator=generator)))
    return out


def weight_set(size: str) -> list[tuple[str, torch.Tensor]]:
    if size == "tiny":
        return tiny_weights()
    return synthetic_weights({"100MB": 100 << 20, "1GB": 1 << 30}[size])


# ---------------------------------------------------------------------------------------------- the two actors
@ray.remote(num_cpus=0)
class Trainer:
    """The sending side: holds a weight set and one engine or transport per candidate."""

    def __init__(self) -> None:
        self.weights: list[tuple[str, torch.Tensor]] = []
        self.engine = ObjectStoreCheckpointEngine(is_master=True)
        self.pg: Any = None
        self.segment: str | None = None

    def load(self, size: str) -> dict[str, int]:
        self.weights = weight_set(size)
        return {
            "bytes": sum(t.numel() * t.element_size() for _, t in self.weights),
            "tensors": len(self.weights),
        }

    def layout(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(name, t.dtype, tuple(t.shape)) for name, t in self.weights]

    def engine_call(self, method: str, **kwargs: Any) -> Any:
        return getattr(self.engine, method)(**kwargs)

    async def engine_send(self, version: int) -> dict[str, float]:
        return await self.engine.send_weights(iter(self.weights), global_steps=version)

    def gloo_store(self) -> int:
        self.store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
        return int(self.store.port)

    def gloo_join(self) -> None:
        self.pg = _gloo_group(self.store, 0)

    def gloo_send(self) -> None:
        for _, tensor in self.weights:
            self.pg.broadcast(tensor, 0).wait()

    def shm_write(self) -> tuple[str, int]:
        total = sum(t.numel() * t.element_size() for _, t in self.weights)
        self.segment = f"/dev/shm/aglverl-bench-{uuid.uuid4().hex}"
        buffer = torch.from_file(self.segment, shared=True, size=total, dtype=torch.uint8)
        offset = 0
        for _, tensor in self.weights:
            raw = tensor.reshape(-1).view(torch.uint8)
            buffer[offset : offset + raw.numel()].copy_(raw)
            offset += raw.numel()
        return self.segment, total

    def shm_unlink(self) -> None:
        if self.segment is not None:
            os.unlink(self.segment)
            self.segment = None


@ray.remote(num_cpus=0)
class Rollout:
    """The receiving side: ends each sync holding its own copy of every tensor."""

    def __init__(self) -> None:
        self.engine = ObjectStoreCheckpointEngine()
        self.received: list[tuple[str, torch.Tensor]] = []
        self.layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.pg: Any = None

    def engine_call(self, method: str, **kwargs: Any) -> Any:
        return getattr(self.engine, method)(**kwargs)

    async def engine_receive(self, version: int) -> int:
        self.received = [(n, t.clone()) async for n, t in self.engine.receive_weights(global_steps=version)]
        return len(self.received)

    def gloo_join(self, port: int, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self.layout = layout
        self.pg = _gloo_group(torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=False), 1)

    def gloo_receive(self) -> int:
        self.received = []
        for name, dtype, shape in self.layout:
            tensor = torch.empty(shape, dtype=dtype)
            self.pg.broadcast(tensor, 0).wait()
            self.received.append((name, tensor))
        return len(self.received)

    def shm_read(self, path: str, total: int, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
        buffer = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self.received, offset = [], 0
        for name, dtype, shape in layout:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            self.received.append((name, buffer[offset : offset + nbytes].view(dtype).view(shape).clone()))
            offset += nbytes
        return len(self.received)

    def drop(self) -> None:
        self.received = []


def _gloo_group(store: Any, rank: int) -> Any:
    return torch.distributed.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=CALL_TIMEOUT))


# ---------------------------------------------------------------------------------------------- one sync each
def _get(refs: Any) -> Any:
    return ray.get(refs, timeout=CALL_TIMEOUT)


def sync_object_store(trainer: Any, rollout: Any, version: int) -> float:
    """One sync through aglverl's engine, step by step as verl's CheckpointEngineManager runs it; returns the
    seconds of its transfer phase (send_weights and receive_weights) alone."""
    metadata = _get([trainer.engine_call.remote("prepare"), rollout.engine_call.remote("prepare")])
    actor_kwargs, rollout_kwargs = ObjectStoreCheckpointEngine.build_topology(1, 1, metadata)
    _get(
        [
            trainer.engine_call.remote("init_process_group", **{k: v[0] for k, v in actor_kwargs.items()}),
            rollout.engine_call.remote("init_process_group", **{k: v[0] for k, v in rollout_kwargs.items()}),
        ]
    )
    start = time.perf_counter()
    _get([trainer.engine_send.remote(version), rollout.engine_receive.remote(version)])
    transfer = time.perf_counter() - start
    _get([trainer.engine_call.remote("finalize"), rollout.engine_call.remote("finalize")])
    return transfer


def sync_gloo(trainer: Any, rollout: Any, version: int) -> None:
    _get([trainer.gloo_send.remote(), rollout.gloo_receive.remote()])


def sync_shared_memory(trainer: Any, rollout: Any, version: int) -> None:
    path, total = _get(trainer.shm_write.remote())
    _get(rollout.shm_read.remote(path, total, _get(trainer.layout.remote())))
    _get(trainer.shm_unlink.remote())


SYNCS: dict[str, Callable[[Any, Any, int], float | None]] = {
    "object_store": sync_object_store,
    "gloo": sync_gloo,
    "shared_memory": sync_shared_memory,
}


def measure(transport: str, trainer: Any, rollout: Any, repeats: int) -> dict[str, Any]:
    sync = SYNCS[transport]
    seconds, transfers = [], []
    for version in range(repeats + 1):
        _get(rollout.drop.remote())
        start = time.perf_counter()
        transfer = sync(trainer, rollout, version)
        seconds.append(time.perf_counter() - start)
        if transfer is not None and version > 0:
            transfers.append(transfer)
    first, timed = seconds[0], seconds[1:]
    row = {
        "median_s": round(statistics.median(timed), 4),
        "min_s": round(min(timed), 4),
        "max_s": round(max(timed), 4),
        "first_s": round(first, 4),
        "n": len(timed),
    }
    if transfers:  # the engine's own part, without verl's per-sync protocol round trips
        row["transfer_median_s"] = round(statistics.median(transfers), 4)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed syncs per transport and size (default 5)"
    )
    args = parser.parse_args()

    loopback_only_ray()
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"}
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
    )
    results: dict[str, Any] = {"sizes": {}, "seconds_per_sync": {t: {} for t in args.transports}}
    try:
        for size in args.sizes:
            trainer, rollout = Trainer.remote(), Rollout.remote()
            try:
                results["sizes"][size] = _get(trainer.load.remote(size))
                if "gloo" in args.transports:
                    port, layout = _get([trainer.gloo_store.remote(), trainer.layout.remote()])
                    _get([trainer.gloo_join.remote(), rollout.gloo_join.remote(port, layout)])
                for transport in args.transports:
                    row = measure(transport, trainer, rollout, args.repeats)
                    row["GB_per_s"] = round(results["sizes"][size]["bytes"] / row["median_s"] / 1e9, 3)
                    results["seconds_per_sync"][transport][size] = row
                    print(f"{transport:>14} {size:>6}: {row}", file=sys.stderr, flush=True)
            finally:
                ray.kill(trainer)
                ray.kill(rollout)
    finally:
        ray.shutdown()
    results["machine"] = machine_info() | {
        "torch": torch.__version__,
        "ray": ray.__version__,
        "mem_total_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
