"""Record a real vLLM's tool-call, reasoning and token-in answers on the tiny model, as test fixtures.

Run against a vLLM started on the tiny model's directory with the scale-out routes and the Hermes parser::

    python -m vllm.entrypoints.openai.api_server --model DIR --served-model-name tiny --enable-scale-out \\
        --dtype float32 --enforce-eager --max-model-len 512 --enable-auto-tool-choice --tool-call-parser hermes \\
        [--reasoning-parser qwen3]
    python tests/helpers/record_vllm_chat.py http://127.0.0.1:PORT OUT.json [LABEL]

It writes one JSON file: ``{"label", "server": {...flags...}, "render": [...], "generate": [...], "chat":
[...], "derender": [...]}`` where each derender case holds the generated text, its ids, the chat request, and
vLLM's non-streaming answer and its per-token streaming answers (chunks threaded through ``stream_state``).
``tests/test_chat_parser.py`` replays the derender cases against aglverl's parser and checks the answers
agree; ``tests/test_token_in.py`` compares shapes. Nothing here is imported by aglverl.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now.", "parameters": {}}},
]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
HISTORY = [
    *MESSAGES,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
#: Generated texts (the EOS is appended unless the case says ``length``).
OUTPUTS: dict[str, tuple[str, str]] = {
    "plain": ("Hello there. The answer is yes.", "stop"),
    "one_call": (CALL, "stop"),
    "content_then_two_calls": ("Let me check." + CALL + "\n" + CALL2, "stop"),
    "think_then_call": ("<think>\nthe user wants weather\n</think>\n\n" + CALL, "stop"),
    "think_then_text": ("<think>hmm, yes</think>The answer is yes.", "stop"),
    "end_think_only": ("the user wants weather</think>\n\nThe answer is yes.", "stop"),
    "bad_json_call": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', "stop"),
    "truncated_call": ('<tool_call>\n{"name": "get_weather", "argu', "length"),
    "partial_tag_at_end": ("The answer is <tool_", "length"),
    "compact_call": ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "stop"),
    "unicode": ("Caf\u00e9 \u2014 na\u00efve \U0001f600", "stop"),
}
CHAT_REQUESTS: dict[str, dict[str, Any]] = {
    "no_tools": {},
    "auto": {"tools": TOOLS},
    "none": {"tools": TOOLS, "tool_choice": "none"},
    "required": {"tools": TOOLS, "tool_choice": "required"},
    "named": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "auto_no_thinking": {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
}


def _post(client: httpx.Client, path: str, body: Any) -> Any:
    resp = client.post(path, json=body)
    try:
        answer = resp.json()
    except ValueError:
        answer = resp.text
    return {"status": resp.status_code, "body": answer}


def _sse(client: httpx.Client, path: str, body: Any) -> list[Any]:
    events = []
    with client.stream("POST", path, json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _compact(answer: dict[str, Any]) -> dict[str, Any]:
    """A derender answer without the parts that repeat: status, the choice's message and finish, usage."""
    body = answer["body"]
    if answer["status"] != 200:
        return answer
    choice = body["choices"][0]
    return {
        "status": 200,
        "message": choice["message"],
        "finish_reason": choice["finish_reason"],
        "usage": body["usage"],
        "keys": sorted(body),
        "choice_keys": sorted(choice),
    }


def _compact_chunk(chunk: dict[str, Any]) -> dict[str, Any]:
    if "status" in chunk:
        return chunk
    choices = chunk.get("choices") or [{}]
    return {"delta": choices[0].get("delta"), "finish_reason": choices[0].get("finish_reason")}


def main(url: str, out: str, label: str) -> None:
    from transformers import AutoTokenizer

    client = httpx.Client(base_url=url, timeout=60)
    root = client.get("/v1/models").json()["data"][0]["root"]
    tok = AutoTokenizer.from_pretrained(root)
    eos = tok.eos_token_id
    record: dict[str, Any] = {"label": label, "models": client.get("/v1/models").json()}
    renders = {
        "plain": {"messages": MESSAGES},
        "tools_auto": {"messages": MESSAGES, "tools": TOOLS},
        "tools_required": {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 40},
        "tools_named": {"messages": MESSAGES, **CHAT_REQUESTS["named"], "seed": 3, "logprobs": True},
        "history": {"messages": HISTORY, "tools": TOOLS},
        "history_no_generation_prompt": {"messages": HISTORY, "tools": TOOLS, "add_generation_prompt": False},
        "assistant_tail": {
            "messages": [*MESSAGES, {"role": "assistant", "content": "yes"}],
            "add_generation_prompt": False,
        },
        "continue_final": {
            "messages": [*MESSAGES, {"role": "assistant", "content": "The answer"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        "no_tool_choice_without_tools": {"messages": MESSAGES, "tool_choice": "required"},
        "unknown_named_tool": {
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    }
    record["render"] = {
        name: {
            "request": {"model": "tiny", **body},
            "answer": _post(client, "/v1/chat/completions/render", {"model": "tiny", **body}),
        }
        for name, body in renders.items()
    }
    generated = []
    for name in ("plain", "tools_named"):
        request = dict(record["render"][name]["answer"]["body"])
        if "sampling_params" not in request:
            raise RuntimeError(f"render {name} failed: {request}")
        request["sampling_params"] |= {"max_tokens": 8, "seed": 5, "logprobs": 1 if name == "plain" else None}
        answer = _post(client, "/inference/v1/generate", request)
        stream = _sse(client, "/inference/v1/generate", {**request, "stream": True})
        generated.append({"name": name, "request": request, "answer": answer, "stream": stream})
    record["generate"] = generated
    chats = {
        "auto_json": {
            "messages": MESSAGES,
            "tools": TOOLS,
            "max_tokens": 24,
            "seed": 1,
            "return_token_ids": True,
        },
        "required_json": {
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 80,
            "seed": 1,
            "return_token_ids": True,
        },
        "named_stream": {
            "messages": MESSAGES,
            **CHAT_REQUESTS["named"],
            "max_tokens": 80,
            "seed": 2,
            "stream": True,
            "return_token_ids": True,
        },
        "required_stream": {
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 80,
            "seed": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    }
    record["chat"] = {}
    for name, body in chats.items():
        body = {"model": "tiny", **body}
        if body.get("stream"):
            record["chat"][name] = {"request": body, "stream": _sse(client, "/v1/chat/completions", body)}
        else:
            record["chat"][name] = {"request": body, "answer": _post(client, "/v1/chat/completions", body)}
    cases = []
    for out_name, (text, finish) in OUTPUTS.items():
        ids = tok.encode(text, add_special_tokens=False) + ([eos] if finish == "stop" else [])
        for req_name, extra in CHAT_REQUESTS.items():
            chat_request = {"model": "tiny", "messages": MESSAGES, **extra}
            prompt = _post(client, "/v1/chat/completions/render", chat_request)["body"]["token_ids"]
            gen = {
                "request_id": f"chatcmpl-{out_name}",
                "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish, "stop_reason": None}],
            }
            full = _post(
                client,
                "/v1/chat/completions/derender",
                {
                    "model": "tiny",
                    "generate_response": gen,
                    "prompt_token_ids": prompt,
                    "prompt_tokens": len(prompt),
                    "chat_request": chat_request,
                },
            )
            state = None
            chunks = []
            for k, token in enumerate(ids):
                last = k == len(ids) - 1
                chunk = {
                    "request_id": f"chatcmpl-{out_name}",
                    "choices": [
                        {"index": 0, "token_ids": [token], "finish_reason": finish if last else None}
                    ],
                }
                answer = _post(
                    client,
                    "/v1/chat/completions/derender",
                    {
                        "model": "tiny",
                        "stream": True,
                        "generate_chunk": chunk,
                        "stream_state": state,
                        "prompt_token_ids": prompt,
                        "prompt_tokens": len(prompt),
                        "chat_request": chat_request,
                    },
                )
                if answer["status"] != 200:
                    chunks.append(answer)
                    break
                state = answer["body"]["stream_state"]
                chunks.append(answer["body"]["chunk"])
            record.setdefault("prompts", {})[req_name] = prompt
            cases.append(
                {
                    "output": out_name,
                    "text": text,
                    "token_ids": ids,
                    "finish_reason": finish,
                    "chat_request": req_name,
                    "derender": _compact(full),
                    "stream": [_compact_chunk(c) for c in chunks],
                }
            )
    record["derender"] = cases
    with open(out, "w") as f:
        json.dump(record, f, separators=(",", ":"), ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
