"""Validate answers of aglverl's Agent Lightning API with Agent Lightning's own pydantic models.

Run by the Agent Lightning tier's Python (``.venv-agl``, ``agentlightning==1.0.2``): reads ``{"answers": [{"model":
NAME, "body": JSON}, ...]}`` on stdin and prints ``{"errors": [...], "valid_transitions": {...}}``. An answer is
valid when Agent Lightning's model of that name accepts it AND dumps it back to exactly the same JSON (no field
missing, added or shaped differently); ``model_request`` and ``reward`` events' data are also checked against
``ModelRequestData`` / ``RewardData`` unless trimmed (``format=triplet``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from agentlightning import schemas
from agentlightning.server.routes.proxy import PauseStateResponse
from agentlightning.server.routes.rollouts import RolloutDetail, TerminalRolloutsPage
from pydantic import BaseModel, TypeAdapter

MODELS: dict[str, Any] = {
    "Rollout": schemas.Rollout,
    "RolloutDetail": RolloutDetail,
    "TerminalRolloutsPage": TerminalRolloutsPage,
    "Event": schemas.Event,
    "Model": schemas.Model,
    "PauseStateResponse": PauseStateResponse,
    "status": dict[str, str],
}


def check(name: str, body: Any, triplet: bool) -> str | None:
    many = name.startswith("list[")
    inner = name[5:-1] if many else name
    adapter = TypeAdapter(list[MODELS[inner]] if many else MODELS[inner])
    try:
        value = adapter.validate_python(body)
    except Exception as exc:
        return f"{name}: {exc}"
    dumped = adapter.dump_python(value, mode="json")
    if dumped != body:
        return f"{name}: Agent Lightning reads it as {json.dumps(dumped)[:800]}, but it was {json.dumps(body)[:800]}"
    for event in value if many else [value]:
        if isinstance(event, schemas.Event) and not triplet:
            data_model: type[BaseModel] | None = {
                "model_request": schemas.ModelRequestData,
                "reward": schemas.RewardData,
            }.get(event.event_type)
            if data_model is not None:
                try:
                    data_model.model_validate(event.data)
                except Exception as exc:
                    return f"{name}: {event.event_type} data: {exc}"
    return None


def main() -> None:
    request = json.load(sys.stdin)
    errors = [
        error
        for answer in request["answers"]
        if (error := check(answer["model"], answer["body"], answer.get("triplet", False))) is not None
    ]
    transitions = {str(k): sorted(str(s) for s in v) for k, v in schemas.VALID_TRANSITIONS.items()}
    json.dump(
        {"errors": errors, "checked": len(request["answers"]), "valid_transitions": transitions}, sys.stdout
    )


if __name__ == "__main__":
    main()
