"""A program written for Agent Lightning 0.3's ``agl.VERL``, as its docs write it (a multi-turn ``async``
``@agl.rollout`` agent); it imports nothing of aglverl.

``aglverl fit seed_program_unchanged.py --log FILE --steps N`` trains it on aglverl. Its last stdout line says
which class ``agl.VERL`` made, and whether ``from agentlightning.algorithm.verl import VERL`` named the same one.
"""

from __future__ import annotations

import argparse
import json

import agentlightning as agl
from agentlightning.algorithm.verl import VERL
from seed_agents import multiturn_agent

parser = argparse.ArgumentParser()
parser.add_argument("--log", required=True)
parser.add_argument("--steps", type=int, default=2)
args = parser.parse_args()

config = {
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 4, "shuffle": False},
    "actor_rollout_ref": {
        "rollout": {"n": 2, "multi_turn": {"format": "hermes"}},
        "actor": {"ppo_mini_batch_size": 2, "use_kl_loss": False, "entropy_coeff": 0},
        "model": {"path": "tiny"},
    },
    # agl.VERL's documented trajectory aggregation: data.max_response_length bounds each call, the
    # trajectory widths each merged row
    "agentlightning": {
        "trace_aggregator": {
            "level": "trajectory",
            "trajectory_max_prompt_length": 64,
            "trajectory_max_response_length": 96,
        }
    },
    "trainer": {
        "val_before_train": False,
        "logger": ["console", "file"],
        "project_name": "AgentLightning",
        "experiment_name": "seed",
        "total_training_steps": args.steps,
        "save_freq": -1,
        "test_freq": -1,
    },
}
train = [
    {"prompt": "Say yes.", "reward": 0.25 + 0.5 * (i % 2), "split": "train", "log": args.log}
    for i in range(8)
]

algorithm = agl.VERL(config)
trainer = agl.Trainer(algorithm=algorithm, n_runners=2)
trainer.fit(multiturn_agent, train_dataset=train)
print(
    json.dumps(
        {
            "fit_returned": True,
            "algorithm": f"{type(algorithm).__module__}.{type(algorithm).__name__}",
            "same_class": type(algorithm) is VERL,
        }
    )
)
