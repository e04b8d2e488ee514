"""An agent that draws one number from each random generator a Python agent may use, and prints them as one JSON
line (nothing of aglverl). numpy and torch are imported at the top: the fork server's template imports them, and
every attempt is a fork of it (with ``OMP_NUM_THREADS=1``: their imports then start no thread)."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import torch

#: Generator objects made at import (in the template): each fork starts from the same state.
MODULE_RANDOM = random.Random()
MODULE_RNG = np.random.default_rng()


class Draws:
    def run(self) -> None:
        seed = int(os.environ["AGL_SEED"])
        drawn = {
            "random": random.random(),
            "numpy": float(np.random.random()),
            "torch": float(torch.rand(1)),
            "module_random": MODULE_RANDOM.random(),
            "module_rng": float(MODULE_RNG.random()),
            "seeded_random": random.Random(seed).random(),
            "seeded_rng": float(np.random.default_rng(seed).random()),
            "seed": seed,
        }
        print(json.dumps(drawn), flush=True)
        with open(os.environ["AGL_REWARD_FILE"], "w") as f:
            f.write("1")
