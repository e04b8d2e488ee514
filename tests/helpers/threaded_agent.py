"""An agent class whose module starts a thread when it is imported (a library's background thread, say): the
fork server must not fork a process that runs it. Its import is counted like :mod:`forked_agents`'."""

from __future__ import annotations

import os
import threading
import time

if os.environ.get("IMPORT_LOG"):
    with open(os.environ["IMPORT_LOG"], "a") as f:
        f.write(f"{os.getpid()}\n")

threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()


class ThreadedAtImport:
    def run(self) -> None:
        with open(os.environ["AGL_REWARD_FILE"], "w") as f:
            f.write(f"{threading.active_count()}")
