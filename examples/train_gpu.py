"""The GPU recipe: GRPO on a real instruction model with verl's vLLM rollout, agents in this process.

    pip install "aglverl[gpu]"                      # verl's vLLM stack (CUDA torch; see the README)
    python examples/train_gpu.py --model Qwen/Qwen2.5-1.5B-Instruct --train data/train.parquet --val data/test.parquet

The config is verl's own (``ppo_trainer.yaml``), in the shape of Agent Lightning's VERL examples and verl's
GRPO docs; every key can be overridden as on verl's command line (``--set trainer.n_gpus_per_node=8``). The
agent is the calculator tool-use agent of ``examples/calculator.py``; the datasets are parquet or JSON-lines
files whose rows are its task inputs (``{"question": ..., "answer": ...}``). Scale-out is verl's and Ray's:
more GPUs per node with ``trainer.n_gpus_per_node``, more nodes with ``trainer.nnodes`` and a Ray cluster
joined through ``RAY_ADDRESS``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import anyio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calculator import agent

from aglverl.algorithm import AsyncVERL


def recipe(model: str, n_gpus: int) -> dict[str, Any]:
    """GRPO with a KL loss, vLLM rollout, FSDP actor with offloading: Agent Lightning's VERL recipe shape."""
    return {
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "data": {"train_batch_size": 32, "max_prompt_length": 4096, "max_response_length": 2048},
        "actor_rollout_ref": {
            "model": {"path": model, "use_remove_padding": True, "enable_gradient_checkpointing": True},
            "rollout": {
                "name": "vllm",
                "n": 4,
                "tensor_model_parallel_size": 1,
                "gpu_memory_utilization": 0.6,
                "log_prob_micro_batch_size_per_gpu": 4,
            },
            "actor": {
                "ppo_mini_batch_size": 32,
                "ppo_micro_batch_size_per_gpu": 4,
                "optim": {"lr": 1e-6},
                "use_kl_loss": True,
                "kl_loss_coef": 0.001,
                "entropy_coeff": 0,
                "clip_ratio_low": 0.2,
                "clip_ratio_high": 0.3,
                "fsdp_config": {"param_offload": True, "optimizer_offload": True},
            },
            "ref": {"log_prob_micro_batch_size_per_gpu": 8, "fsdp_config": {"param_offload": True}},
        },
        "trainer": {
            "n_gpus_per_node": n_gpus,
            "nnodes": 1,
            "val_before_train": True,
            "critic_warmup": 0,
            "logger": ["console", "wandb"],
            "project_name": "aglverl",
            "experiment_name": "calculator_grpo",
            "save_freq": 64,
            "test_freq": 16,
            "total_epochs": 2,
        },
        "aglverl": {"platform": "gpu", "step_timeout": 1800},
    }


def _parse(value: str) -> Any:
    """A command-line value: JSON when it parses (numbers, booleans, lists), else the string itself."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face model id or local directory")
    parser.add_argument("--train", required=True, help="training tasks (.parquet or .jsonl)")
    parser.add_argument("--val", help="validation tasks (.parquet or .jsonl)")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = parser.parse_args()
    config = recipe(args.model, args.gpus)
    for item in args.set:
        key, _, value = item.partition("=")
        config[key] = _parse(value)
    metrics = anyio.run(AsyncVERL(config, agent=agent).run, args.train, args.val)
    print(json.dumps({k: v for k, v in metrics.items() if k.startswith(("training/", "val/"))}))


if __name__ == "__main__":
    main()
