"""The Responses API's stored responses as that API speaks of them: a call that continues one, what a response
is kept as, and the routes that read them back.

- **Continuing** (``previous_response_id``): :func:`continued` finds the stored response of the call's own
  attempt (:class:`~aglverl.proxy.api.response_store.ResponseStore`); an id it does not have is refused as
  OpenAI refuses an unknown one (400, ``code: "previous_response_not_found"``, ``param:
  "previous_response_id"``), saying why it is gone when the store knows (dropped for the bounds, deleted).
  Its items (:meth:`StoredResponse.conversation
  <aglverl.proxy.api.response_store.StoredResponse.conversation>`: the earlier inputs and outputs of its
  conversation, its own last, oldest first) come before the call's own input, after the
  call's own ``instructions`` (those of earlier calls are not carried over, as OpenAI does not carry them): the
  chat call the backend gets holds the whole conversation, exactly as the earlier calls' messages and answers,
  so token-in (:mod:`~aglverl.proxy.tokenin`) finds the recorded turn it extends and generates it from that
  turn's exact ids. An input item whose ``id`` is already in the conversation is refused (400), as OpenAI
  refuses a duplicate item.
- **Keeping** (``store`` left out or true): :func:`listed_input` gives the call's input as it is kept (an
  ``id`` on every item, a string input one user message) and :func:`keep` stores the response once its answer
  is whole (``completed`` or ``incomplete``; a failed one is not kept).
- **Reading back**: :func:`retrieve` (``GET /v1/responses/{response_id}``: the response object as answered;
  ``stream=true`` refused), :func:`delete` (``DELETE``: ``{"id", "object": "response", "deleted": true}``) and
  :func:`input_items` (``GET /v1/responses/{response_id}/input_items``: OpenAI's list, ``object: "list"``,
  ``data``, ``first_id``, ``last_id``, ``has_more``; ``order`` ``asc``/``desc`` (default ``desc``), ``after``
  and ``before`` item ids, ``limit`` 1-100 (default 20)). An unknown id is a 404 (``Response with id '...' not found.``,
  ``param: "response_id"``), as OpenAI (and vLLM) answer it. The ``include`` query is taken and ignored.

Every refusal is a :class:`~aglverl.proxy.api.translator.TranslationError` naming the field; the routes' glue
(:mod:`~aglverl.proxy.api.responses`) answers it in the API's error shape. Pure: nothing here awaits anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs

import orjson

from .response_store import StoredResponse
from .translator import Exchange, TranslationError, bad_field, new_id

__all__ = [
    "PREVIOUS_NOT_FOUND",
    "continued",
    "delete",
    "input_items",
    "keep",
    "listed_input",
    "refuse_duplicates",
    "retrieve",
]

#: OpenAI's error code for an unknown ``previous_response_id``.
PREVIOUS_NOT_FOUND = "previous_response_not_found"
#: Id prefixes of kept input items, by type.
_ITEM_PREFIX: Mapping[str, str] = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
_LIMIT_DEFAULT, _LIMIT_MAX = 20, 100


def _nothing_kept(ex: Exchange, response_id: str) -> str:
    """Why the call's attempt has no response ``response_id``."""
    if ex.responses is None:
        return "this proxy keeps no responses"
    why = ex.responses.why_gone(ex.attempt, response_id)
    if why is not None:
        return why
    scope = "this rollout attempt" if ex.attempt[0] is not None else "the proxy's unattributed /v1 calls"
    return (
        f"responses are kept per rollout attempt, and {scope} has none with this id (a response of another "
        "attempt or rollout, or one made with store: false, is not found)"
    )


# ---------------------------------------------------------------------------------------------- continuing
def _find(
    ex: Exchange, response_id: str, what: str, status: int, param: str, code: str | None = None
) -> StoredResponse:
    """The attempt's response ``response_id``, or the refusal saying why it has none."""
    found = ex.responses.get(ex.attempt, response_id) if ex.responses is not None else None
    if found is None:
        message = f"{what} with id '{response_id}' not found: {_nothing_kept(ex, response_id)}."
        raise TranslationError(status, message, param, code)
    return found


def continued(ex: Exchange, response_id: str) -> StoredResponse:
    """The stored response a call continues; a :class:`TranslationError` (400, OpenAI's
    ``previous_response_not_found``) when the call's attempt has none with that id."""
    return _find(ex, response_id, "Previous response", 400, "previous_response_id", PREVIOUS_NOT_FOUND)


def refuse_duplicates(previous: StoredResponse, raw_input: Any) -> None:
    """Refuse (400) an input item whose ``id`` is already an item of the conversation it continues."""
    if not isinstance(raw_input, list):
        return
    given = {
        item["id"]: i
        for i, item in enumerate(raw_input)
        if isinstance(item, dict) and type(item.get("id")) is str
    }
    if not given:
        return
    for item in previous.conversation():
        i = given.get(item.get("id"))
        if i is not None:
            raise bad_field(
                f"input.{i}.id",
                f"duplicate item: '{item['id']}' is already in the conversation of previous_response_id "
                f"'{previous.id}' (send only the new items when continuing a response)",
            )


# ---------------------------------------------------------------------------------------------- keeping
def listed_input(raw_input: str | list[Any]) -> tuple[dict[str, Any], ...]:
    """The call's (already validated) input as it is kept and listed: a string is one user message; every
    item gets an ``id`` when it has none (the caller's item is not changed)."""
    if isinstance(raw_input, str):
        return ({"id": new_id("msg"), "type": "message", "role": "user", "content": raw_input},)
    items = []
    for item in raw_input:
        if item.get("id") is None:
            kind = item.get("type") or "message"
            item = {"id": new_id(_ITEM_PREFIX.get(kind, "item")), **item}
        items.append(item)
    return tuple(items)


def keep(
    ex: Exchange,
    response: Mapping[str, Any],
    input_: tuple[dict[str, Any], ...],
    previous: StoredResponse | None,
) -> bool:
    """Store a whole response (``completed`` or ``incomplete``) for the call's attempt; ``False`` when it is
    not kept (no store, a failed response, or larger than the attempt's bound)."""
    if ex.responses is None or response.get("status") not in ("completed", "incomplete"):
        return False
    body = orjson.dumps(response)
    output = tuple(response.get("output") or ())
    items_bytes = len(orjson.dumps(input_)) + len(orjson.dumps(output))
    stored = StoredResponse(str(response["id"]), body, input_, output, previous, items_bytes)
    return ex.responses.put(ex.attempt, stored)


# ---------------------------------------------------------------------------------------------- reading back
def _stored(ex: Exchange) -> StoredResponse:
    return _find(ex, ex.params["response_id"], "Response", 404, "response_id")


def _query(ex: Exchange) -> dict[str, str]:
    """The query's parameters (the last value of each; ``include[]`` and ``include`` alike are ignored)."""
    return {key: values[-1] for key, values in parse_qs(ex.query, keep_blank_values=True).items()}


def retrieve(ex: Exchange) -> bytes:
    """``GET /v1/responses/{response_id}``: the stored response object, as the agent got it."""
    query = _query(ex)
    if query.get("stream", "false").lower() not in ("false", "0", ""):
        raise bad_field(
            "stream", "a stored response is read back whole: streaming it is for background responses"
        )
    return _stored(ex).body


def delete(ex: Exchange) -> bytes:
    """``DELETE /v1/responses/{response_id}``: the attempt's response deleted (a response that continued it
    keeps its conversation)."""
    stored = _stored(ex)
    assert ex.responses is not None
    ex.responses.delete(ex.attempt, stored.id)
    return orjson.dumps({"id": stored.id, "object": "response", "deleted": True})


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    """An item as OpenAI lists it: a message's text content as content parts, every item with a status."""
    item = {**item, "status": item.get("status") or "completed"}
    if item.setdefault("type", "message") == "message" and isinstance(item.get("content"), str):
        if item.get("role") == "assistant":
            part: dict[str, Any] = {"type": "output_text", "text": item["content"], "annotations": []}
        else:
            part = {"type": "input_text", "text": item["content"]}
        item["content"] = [part]
    return item


def _page(items: list[dict[str, Any]], query: Mapping[str, str]) -> tuple[list[dict[str, Any]], bool]:
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_field("order", f"must be 'asc' or 'desc', not '{order}'")
    try:
        limit = int(query.get("limit", _LIMIT_DEFAULT))
    except ValueError:
        raise bad_field("limit", f"must be an integer, not '{query['limit']}'") from None
    if not 1 <= limit <= _LIMIT_MAX:
        raise bad_field("limit", f"must be between 1 and {_LIMIT_MAX}, not {limit}")
    if order == "desc":
        items.reverse()
    ids = [item.get("id") for item in items]
    for cursor in ("after", "before"):
        if query.get(cursor) and query[cursor] not in ids:
            raise bad_field(cursor, f"no input item of this response has the id '{query[cursor]}'")
    start = ids.index(query["after"]) + 1 if query.get("after") else 0
    end = ids.index(query["before"]) if query.get("before") else len(items)
    if query.get("before") and not query.get("after"):  # the page that ends right before the cursor
        start = max(0, end - limit)
        return items[start:end], start > 0
    return items[start : min(end, start + limit)], start + limit < end


def input_items(ex: Exchange) -> bytes:
    """``GET /v1/responses/{response_id}/input_items``: the items the response was made from, as OpenAI lists
    them (the earlier input and output of its conversation, then its own input)."""
    page, more = _page(list(_stored(ex).context()), _query(ex))
    data = [_listed(item) for item in page]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return orjson.dumps(
        {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}
    )
