"""The GPU recipe: GRPO on a real instruction model with verl's vLLM rollout, agents in this process.

It needs CUDA GPUs and verl's GPU stack, installed from a clone of aglverl (the package is not on an index)::

    git clone <aglverl> && cd aglverl && pip install -e ".[gpu]"    # verl's vLLM extra, with its CUDA torch

Then make the data (rows ``{"question": str, "answer": number}``, the calculator agent's task inputs) and train::

    python examples/train_gpu.py --make-data gsm8k.jsonl --train data/train.parquet --val data/test.parquet
    python examples/train_gpu.py --model Qwen/Qwen2.5-1.5B-Instruct --train data/train.parquet \\
        --val data/test.parquet --gpus 8

``--make-data SOURCE`` reads a JSON-lines, JSON or parquet file, or a Hugging Face dataset named
``hf:NAME[:CONFIG]`` (e.g. ``hf:openai/gsm8k:main``, downloaded by the ``datasets`` library), keeps each row's
question (``--question-field``, default ``question``) and numeric answer (``--answer-field``, default
``answer``; GSM8K's worked answers end in ``#### <number>``, which is what is kept), and writes a training and
a validation parquet file (``--val-fraction``, 0.1). The same in a few lines of your own::

    import pandas as pd
    rows = pd.read_json("gsm8k.jsonl", lines=True)
    rows["answer"] = rows["answer"].str.split("####").str[-1].str.replace(",", "").astype(float)
    rows[["question", "answer"]].to_parquet("data/train.parquet")

The config is verl's own (``ppo_trainer.yaml``), in the shape of Agent Lightning's VERL examples and verl's
GRPO docs; every key can be overridden as on verl's command line (``--set trainer.n_gpus_per_node=8``). The
agent is the calculator tool-use agent of ``examples/calculator.py``. Scale-out is verl's and Ray's: more GPUs
per node with ``trainer.n_gpus_per_node``, more nodes with ``trainer.nnodes`` and a Ray cluster joined through
``RAY_ADDRESS``. Without CUDA this script stops at once, saying so (``examples/one_word.py`` and
``aglverl demo`` train on CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
from typing import Any

GPU_INSTALL = 'pip install -e ".[gpu]"'


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


def require_cuda() -> None:
    """Exit (status 2) with what to do when torch sees no CUDA GPU, before anything starts (Ray, models)."""
    try:
        import torch
    except ImportError:
        sys.exit(f"train_gpu.py: torch is not installed; from a clone of aglverl: {GPU_INSTALL}")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + (", a CPU build" if "+cpu" in torch.__version__ else "")
        print(
            f"train_gpu.py needs CUDA GPUs, and torch sees none ({build}).\n"
            f"  On a CUDA machine, from a clone of aglverl: {GPU_INSTALL}  (verl's vLLM stack; the package is "
            "not on an index)\n"
            "  On this machine: python examples/one_word.py, or `aglverl demo` (the tiny model on CPU)",
            file=sys.stderr,
        )
        sys.exit(2)


# ---------------------------------------------------------------------------------------------- data
_FINAL_NUMBER = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def answer_number(value: Any) -> float:
    """A row's answer as a number: a number as is, a string that is one, or GSM8K's ``... #### 42``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    match = _FINAL_NUMBER.search(text)
    return float((match.group(1) if match else text).replace(",", ""))


def read_rows(source: str) -> list[dict[str, Any]]:
    """A dataset's rows: ``hf:NAME[:CONFIG]`` through Hugging Face ``datasets`` (its ``train`` and ``test``
    splits, or its only one), else a .jsonl / .json / .parquet file."""
    if source.startswith("hf:"):
        from datasets import load_dataset

        name, _, config = source[3:].partition(":")
        splits = load_dataset(name, config or None)
        return [dict(row) for split in splits.values() for row in split]
    from aglverl.algorithm import load_samples

    return load_samples(source) or []


def make_data(
    source: str,
    train_path: str,
    val_path: str | None,
    *,
    question_field: str = "question",
    answer_field: str = "answer",
    val_fraction: float = 0.1,
    seed: int = 0,
) -> tuple[int, int]:
    """Write ``{"question", "answer"}`` rows of ``source`` to parquet files (shuffled; ``val_fraction`` of them
    to ``val_path``); returns the rows written to each. A row without the fields, or whose answer is not a
    number, is a ``ValueError`` naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i, row in enumerate(read_rows(source)):
        if question_field not in row or answer_field not in row:
            raise ValueError(
                f"{source}: row {i} has no {question_field!r} or {answer_field!r} field: {row!r:.200}"
            )
        try:
            answer = answer_number(row[answer_field])
        except ValueError:
            raise ValueError(
                f"{source}: row {i}: the answer {row[answer_field]!r:.80} is not a number"
            ) from None
        rows.append({"question": str(row[question_field]), "answer": answer})
    random.Random(seed).shuffle(rows)
    n_val = round(len(rows) * val_fraction) if val_path else 0
    for path, part in ((train_path, rows[n_val:]), (val_path, rows[:n_val])):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            pq.write_table(pa.Table.from_pylist(part), path)
    return len(rows) - n_val, n_val


# ---------------------------------------------------------------------------------------------- main
def _parse(value: str) -> Any:
    """A command-line value: JSON when it parses (numbers, booleans, lists), else the string itself."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a Hugging Face model id or local directory")
    parser.add_argument("--train", required=True, help="training tasks (.parquet or .jsonl)")
    parser.add_argument("--val", help="validation tasks (.parquet or .jsonl)")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    data = parser.add_argument_group("making the data (--make-data writes --train and --val, then exits)")
    data.add_argument(
        "--make-data", metavar="SOURCE", help="a .jsonl/.json/.parquet file or hf:NAME[:CONFIG]"
    )
    data.add_argument("--question-field", default="question")
    data.add_argument("--answer-field", default="answer")
    data.add_argument("--val-fraction", type=float, default=0.1)
    args = parser.parse_args()
    if args.make_data:
        written = make_data(
            args.make_data,
            args.train,
            args.val,
            question_field=args.question_field,
            answer_field=args.answer_field,
            val_fraction=args.val_fraction,
        )
        print(
            json.dumps(
                {"train": args.train, "train_rows": written[0], "val": args.val, "val_rows": written[1]}
            )
        )
        return
    if not args.model:
        parser.error("--model is required to train")
    require_cuda()

    import anyio

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from calculator import agent

    from aglverl.algorithm import AsyncVERL

    config = recipe(args.model, args.gpus)
    for item in args.set:
        key, _, value = item.partition("=")
        config[key] = _parse(value)
    metrics = anyio.run(AsyncVERL(config, agent=agent).run, args.train, args.val)
    print(json.dumps({k: v for k, v in metrics.items() if k.startswith(("training/", "val/"))}))


if __name__ == "__main__":
    main()
