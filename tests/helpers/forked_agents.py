"""Agent classes for the fork server's tests (stdlib only; nothing of aglverl).

Importing this module appends the importing process's pid to the file ``IMPORT_LOG`` names (when set): how a
test counts the imports. :class:`Probe` prints what its process sees (its ids, group, session, working
directory, standard input, open-files limit, whether ``json.tool`` was already imported when it started) as one
JSON line, imports ``json.tool`` (a lazy import the fork server learns), writes the reward ``REWARD``.
:class:`ThreadedAtImport` lives in ``threaded_agent``.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import sys

if os.environ.get("IMPORT_LOG"):
    with open(os.environ["IMPORT_LOG"], "a") as f:
        f.write(f"{os.getpid()}\n")

REWARD = 0.25


class Probe:
    def run(self) -> None:
        seen = {
            "pid": os.getpid(),
            "pgid": os.getpgid(0),
            "sid": os.getsid(0),
            "cwd": os.getcwd(),
            "stdin": sys.stdin.read(),
            "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
            "lazy_was_imported": "json.tool" in sys.modules,
            "argv": sys.argv,
            "secret": os.environ.get("WANDB_API_KEY"),
        }
        importlib.import_module("json.tool")  # imported as it runs: the fork server's template learns it

        print(json.dumps(seen), flush=True)
        with open(os.environ["AGL_REWARD_FILE"], "w") as f:
            f.write(str(REWARD))
