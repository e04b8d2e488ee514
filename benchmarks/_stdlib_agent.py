"""An Agent Lightning v1.0 agent class with the standard library only (``urllib``): one chat call, one reward
event. For ``agent_processes.py``: what starting an agent costs when the agent itself imports next to nothing."""

from __future__ import annotations

import json
import os
import urllib.request


def _post(url: str, body: dict) -> dict:
    key = os.environ.get("AGL_KEY") or ""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP(S)_PROXY
    with opener.open(request, timeout=600) as response:
        return json.load(response)


class StdlibAgent:
    def run(self) -> None:
        base = os.environ["AGL_OPENAI_BASE_URL"]
        reply = _post(
            f"{base}/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Say yes."}]}
        )
        value = 1.0 if "yes" in (reply["choices"][0]["message"]["content"] or "").lower() else 0.0
        _post(os.environ["AGL_EVENT_URL"], {"event_type": "reward", "data": {"value": value}})
