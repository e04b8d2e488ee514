"""An Agent Lightning agent class, run by aglverl's built-in runner in a real training, that does what an agent
must not be able to stop training with (issue 50). Stdlib only, configured by its environment.

Each attempt makes one chat call at ``AGL_OPENAI_BASE_URL``. Its task's ``kind`` (``TASK_KIND``) says what it
does then, the first time that kind runs in the directory ``HOSTILE_DIR`` (later attempts of the kind, and a
``good`` task, write reward 1.0 to ``AGL_REWARD_FILE`` as a well-behaved agent would):

- ``huge``: writes ``1e39`` to ``AGL_REWARD_FILE`` (finite as a Python float, infinite in training's float32);
- ``freeze``: stops its supervisor (``kill -STOP`` on its parent) and sleeps;
- ``late``: posts a reward event of 0.5, ends its own rollout (``PATCH succeeded``: the runner then ends its
  process, which ignores the SIGTERM), then posts a reward of 100 and prints ``late reward: <status> <detail>``
  and the reward events its rollout keeps, then makes the file ``late-done`` in ``HOSTILE_DIR``.

The tasks run unshuffled, two a step: ``huge`` and ``freeze`` in the first, ``late`` and ``good`` in the second.
The second step's well-behaved agents wait for ``late-done`` before they write their rewards: until then the
step cannot end, so the trainer has not yet handed the late rollout over (and dropped it) when the late reward
is posted, and the answer is the ended rollout's, whatever the machine's load.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from typing import Any


def _call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    """One request with the attempt's key; the status and the JSON answer (also for an error status)."""
    key = os.environ.get("AGL_KEY") or ""
    request = urllib.request.Request(
        url,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        method=method,
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=60) as response:
            return int(response.status), json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read() or b"null")


def _first(kind: str) -> bool:
    """Whether this attempt is the first of its kind (it makes the kind's marker file)."""
    try:
        os.close(os.open(os.path.join(os.environ["HOSTILE_DIR"], kind), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class HostileAgent:
    def run(self) -> None:
        chat = {"model": "m", "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 4}
        status, _ = _call("POST", os.environ["AGL_OPENAI_BASE_URL"] + "/chat/completions", chat)
        assert status == 200, status
        kind = os.environ.get("TASK_KIND", "good")
        hostile = kind != "good" and _first(kind)
        print(f"kind {kind}, hostile {hostile}, rollout {os.environ['AGL_ROLLOUT_ID']}", flush=True)
        if hostile and kind == "freeze":
            os.kill(os.getppid(), signal.SIGSTOP)
            time.sleep(3600)
        if hostile and kind == "late":
            self._late()
            return
        if kind in ("late", "good"):
            _wait_for(os.path.join(os.environ["HOSTILE_DIR"], "late-done"), 60)
        with open(os.environ["AGL_REWARD_FILE"], "w") as f:
            f.write("1e39" if hostile and kind == "huge" else "1.0")

    @staticmethod
    def _late() -> None:
        events = os.environ["AGL_EVENT_URL"]
        rollout = events.split("/attempt/")[0]
        assert _call("POST", events, {"event_type": "reward", "data": {"value": 0.5}})[0] == 200
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the runner's SIGTERM once its attempt has ended
        status, answer = _call("PATCH", rollout, {"status": {"state": "succeeded"}})
        assert status == 200 and answer["status"]["state"] == "succeeded", (status, answer)
        status, answer = _call("POST", events, {"event_type": "reward", "data": {"value": 100}})
        print(f"late reward: {status} {answer['detail']}", flush=True)
        _, kept = _call("GET", rollout + "/events?event_type=reward")
        print(f"reward events kept: {[event['data']['value'] for event in kept]}", flush=True)
        _first("late-done")


def _wait_for(path: str, seconds: float) -> None:
    """Until ``path`` exists (checked every 50 ms: a test agent's wait), at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
