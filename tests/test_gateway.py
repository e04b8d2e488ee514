"""The proxy in Agent Lightning's hop's place (:mod:`aglverl.proxy.gateway`), over real loopback sockets: an attempt
with a gateway rule (its agent was started by aglverl's runner) is opened by its own key (or the proxy's token)
and by nothing else, decided at the call's head before a byte of its body is read; its JSON bodies reach the
backend with the rule's fields (the served model, the rollout's temperature). The runner's side (the URL it hands
its agents, the key it revokes) is ``tests/test_process_runner.py``'s."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from helpers.raw_http import Agent, assert_answered, assert_openai_error, chat, claim, proxied, request, route

from aglverl.proxy.gateway import GatewayRule
from aglverl.testing import MockVLLM

pytestmark = pytest.mark.anyio

FIELDS = {"model": "mock", "temperature": 0.7}


def rules_for(rollout_id: str, attempt_id: str, key: str | None) -> Callable[[str, str], GatewayRule | None]:
    """The rules of one attempt (its ``key``; ``None``: revoked); every other attempt has none."""

    def rule(r: str, a: str) -> GatewayRule | None:
        return GatewayRule(key, FIELDS) if (r, a) == (rollout_id, attempt_id) else None

    return rule


@pytest.mark.parametrize("given", [None, "Bearer someone-else", "Bearer k1x", "Bearer proxy-token"])
async def test_a_runner_attempts_call_without_its_key_is_refused_at_its_head_before_its_body(
    given: str | None,
) -> None:
    """No proxy token: the attempt's key is needed all the same (as on the hop), and a call without it gets its 401
    at once, with the connection closed, although its 32 MiB body never comes."""
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        proxy.gateway = rules_for(rid, aid, "k1")
        head = request(
            route(rid, aid), b"", headers=[f"Authorization: {given}"] if given else [], length=False
        )
        head = head.replace(b"\r\n\r\n", b"\r\nContent-Length: %d\r\n\r\n" % (32 << 20))
        async with Agent.connect(proxy.url) as agent:
            await agent.send(head)
            answer = await agent.answer()
            assert answer.status == 401 and answer.header("connection") == "close"
            assert_openai_error(answer.json(), 401, "missing or wrong key", "AGL_KEY")
            assert await agent.rest() == b""
    assert mock.generation_requests() == []


async def test_a_runner_attempts_key_opens_its_calls_only_and_its_bodies_get_the_served_model_and_temperature() -> (
    None
):
    """Its key opens its calls (the model and temperature the agent sent replaced by the rule's), not another
    attempt's; an attempt without a rule goes as ever (no proxy token: open), its body as it came; a revoked key
    opens nothing, and the proxy's token still opens a ruled attempt."""
    body = chat(model="gpt-4o", temperature=0.3)  # a model the backend does not serve
    plain = chat(temperature=0.3)
    async with MockVLLM() as mock, proxied(mock) as (proxy, store):
        rid, aid = claim(store)
        other_rid, other_aid = claim(store)
        proxy.gateway = rules_for(rid, aid, "k1")
        async with Agent.connect(proxy.url) as agent:
            own = await agent.answer_after(
                request(route(rid, aid), body, headers=["Authorization: Bearer k1"])
            )
            other = await agent.answer_after(request(route(other_rid, other_aid), plain))
        assert own is not None and other is not None
        assert_answered(own, mock, {**body, **FIELDS})
        assert_answered(other, mock, plain)
        direct, untouched = (r.json for r in mock.generation_requests())
        assert (direct["model"], direct["temperature"]) == ("mock", 0.7)
        assert untouched["temperature"] == 0.3

        proxy.gateway = rules_for(other_rid, other_aid, "k2")  # k1 is not the other attempt's key
        async with Agent.connect(proxy.url) as agent:
            wrong = await agent.answer_after(
                request(route(other_rid, other_aid), body, headers=["Authorization: Bearer k1"])
            )
        assert wrong is not None and wrong.status == 401

        proxy.gateway = rules_for(rid, aid, None)  # its process is gone
        async with Agent.connect(proxy.url) as agent:
            late = await agent.answer_after(
                request(route(rid, aid), body, headers=["Authorization: Bearer k1"])
            )
        assert late is not None and late.status == 401
    async with MockVLLM() as mock, proxied(mock, token="proxy-token") as (proxy, store):
        rid, aid = claim(store)
        proxy.gateway = rules_for(rid, aid, "k1")
        async with Agent.connect(proxy.url) as agent:
            by_token = await agent.answer_after(
                request(route(rid, aid), body, headers=["Authorization: Bearer proxy-token"])
            )
        assert by_token is not None
        assert_answered(by_token, mock, {**body, **FIELDS})
