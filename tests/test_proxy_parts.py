"""The proxy's package as parts: its imports run one way, no part is built from another's class, and parts
work alone (the gate, the pool, the recorder), each given only what its constructor takes."""

from __future__ import annotations

import ast
import inspect
import pkgutil
import time
from importlib import import_module
from pathlib import Path

import anyio
import orjson
import pytest
from anyio.lowlevel import checkpoint

import aglverl.proxy
from aglverl.metrics import Registry
from aglverl.models import Rollout
from aglverl.proxy import RetryPolicy
from aglverl.proxy.call import Call, ProxyError
from aglverl.proxy.capture import Capture
from aglverl.proxy.config import ProxyConfig
from aglverl.proxy.gate import Gate
from aglverl.proxy.meters import Meters
from aglverl.proxy.pool import Pool
from aglverl.proxy.recorder import Recorder
from aglverl.proxy.session import Sessions
from aglverl.store import LLMCall, TaskStore
from aglverl.testing import load_replay_cases

pytestmark = pytest.mark.anyio

PACKAGE = Path(aglverl.proxy.__file__).parent
CASES = load_replay_cases(Path(__file__).parent / "fixtures" / "vllm")
#: The package's modules, dotted below ``aglverl.proxy`` (``api`` is a subpackage: ``api``, ``api.messages``, ...).
MODULES = sorted(
    info.name.removeprefix("aglverl.proxy.")
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="aglverl.proxy.")
)


def _source(module: str) -> Path:
    path = PACKAGE.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _known(dotted: str) -> str | None:
    """The package's module that an import of ``dotted`` (below ``aglverl.proxy``) loads: itself, or the
    module it names a member of."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports anywhere (``TYPE_CHECKING`` blocks and functions too)."""
    source = _source(module)
    tree = ast.parse(source.read_text())
    here = module.split(".") if source.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:  # from .x import ..., from ..x import ..., from . import x
                base = ".".join(here[: len(here) - node.level + 1])
                stem = ".".join(p for p in (base, node.module or "") if p)
                targets = [f"{stem}.{alias.name}" if stem else alias.name for alias in node.names]
                targets.append(stem)
            elif (node.module or "").startswith("aglverl.proxy."):
                targets = [(node.module or "").removeprefix("aglverl.proxy.")]
        elif isinstance(node, ast.Import):
            targets = [
                a.name.removeprefix("aglverl.proxy.")
                for a in node.names
                if a.name.startswith("aglverl.proxy.")
            ]
        found.update(known for target in targets if (known := _known(target)) is not None)
    return found


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (``[a, b, ..., a]``), or ``None`` when it has none."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_proxy_package_has_no_import_circle() -> None:
    graph = {module: _imports(module) - {module} for module in MODULES if module != "__init__"}
    assert {"app", "gate", "pool", "recorder", "relay", "resume", "tokenin"} <= set(graph)
    assert _circle(graph) is None, f"import circle in aglverl.proxy: {' -> '.join(_circle(graph) or [])}"
    # the parts stand on the vocabulary, never the other way round
    assert not _imports("call") & {"app", "gate", "pool", "recorder", "relay", "resume", "tokenin", "respond"}
    assert _imports("capture") <= {"session"} and _imports("session") == set()


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None


def test_no_class_of_the_proxy_is_built_from_another_of_its_classes() -> None:
    for name in MODULES:
        module = import_module(f"aglverl.proxy.{name}")
        assert module.__doc__ and len(module.__doc__) > 200, f"aglverl.proxy.{name} states no contract"
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or issubclass(cls, BaseException):
                continue  # errors are types, a hierarchy caught by type (HttpError, the upstream's): not parts
            inherited = [base for base in cls.__mro__[1:] if base.__module__.startswith("aglverl.proxy")]
            assert not inherited, f"{cls.__qualname__} inherits {inherited}: parts hold each other instead"


# ---------------------------------------------------------------------------------------------- the gate
async def test_the_gate_alone_drains_on_pause_and_lets_waiting_calls_go_on_resume() -> None:
    meters = Meters(Registry())
    gate = Gate(ProxyConfig(pause_timeout=30.0), meters)
    gate.enter()
    drained, admitted = anyio.Event(), anyio.Event()

    async def pause() -> None:
        await gate.pause()
        drained.set()

    async def admit() -> None:
        await gate.admit()
        admitted.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(pause)
        tg.start_soon(admit)
        while gate.waiting < 1:  # the admission is parked at the gate
            await checkpoint()
        assert gate.paused and gate.closed and not drained.is_set()
        gate.leave()  # the last call in flight ends: the pause returns
        await drained.wait()
        assert not admitted.is_set() and gate.in_flight == 0
        gate.resume(7)
        await admitted.wait()
    assert gate.weight_version == 7 and not gate.closed and gate.waiting == 0
    assert meters.held.value() == 1
    assert gate.activity.busy_intervals(0.0, float("inf"))  # the call's time in flight was recorded


async def test_the_gate_alone_refuses_a_new_call_held_past_hold_timeout() -> None:
    meters = Meters(Registry())
    gate = Gate(ProxyConfig(pause_timeout=0.05, hold_timeout=0.05), meters)
    gate.hold()
    with pytest.raises(ProxyError) as refused:
        await gate.admit()
    assert refused.value.status == 503 and "paused for a weight update" in refused.value.message
    assert gate.held and gate.waiting == 0


@pytest.mark.parametrize(("pause_timeout", "hold_timeout"), [(0.3, 0.05), (0.05, 0.3)])
async def test_the_gates_503_names_the_bound_it_waited_the_longer_of_pause_and_hold_timeout(
    pause_timeout: float, hold_timeout: float
) -> None:
    gate = Gate(ProxyConfig(pause_timeout=pause_timeout, hold_timeout=hold_timeout), Meters(Registry()))
    gate.hold()
    started = time.monotonic()
    with pytest.raises(ProxyError) as refused:
        await gate.admit()
    assert time.monotonic() - started >= 0.3
    assert "for over 0.3s (the longer of the proxy's pause_timeout and hold_timeout)" in refused.value.message


async def test_the_gate_alone_gives_up_a_retried_continuation_once_its_budget_is_spent() -> None:
    meters = Meters(Registry())
    config = ProxyConfig(retry=RetryPolicy(backoff_initial=0.01, backoff_max=0.01, jitter=0.0))
    gate = Gate(config, meters)
    deadline = time.monotonic() + 10.0
    assert await gate.clear_to_retry(deadline, 0, "held", "refused") == deadline  # open, no refusal: go now
    assert await gate.clear_to_retry(deadline, 3, "held", "refused") == deadline  # after a 10 ms backoff
    with pytest.raises(ProxyError) as refused:  # the backoff would end past the budget
        await gate.clear_to_retry(time.monotonic() + 0.005, 3, "held", "kept refusing")
    assert refused.value.status == 503 and refused.value.message == "kept refusing"
    assert meters.resume_failed.value("refused") == 1


# ---------------------------------------------------------------------------------------------- the pool
def test_the_pool_alone_keeps_a_rollout_on_its_backend_and_sends_a_new_one_to_the_least_loaded() -> None:
    pool = Pool(ProxyConfig(), Meters(Registry()), ["http://127.0.0.1:1", "http://127.0.0.1:2/"])
    assert pool.backends == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    first = pool.pick("r1", ())
    assert first is not None
    first.in_flight += 1
    second = pool.pick("r2", ())
    assert second is not None and second is not first  # the least loaded
    second.in_flight += 2
    assert pool.pick("r1", ()) is first  # sticky, though now the busier one
    assert pool.pick("r1", [first]) is second  # a retry goes elsewhere
    pool.forget(["r1"])
    assert pool.pick("r1", ()) is first  # a new rollout again: the least loaded
    with pytest.raises(ValueError, match="no path"):
        pool.set_backends(["http://127.0.0.1:1/v1"])


# ---------------------------------------------------------------------------------------------- the recorder
def _answered_call(store: TaskStore, ids: list[int], prompt: list[int]) -> tuple[Call, bytes]:
    """A recorded chat call of a newly claimed attempt that asked for at most 3 tokens, and the backend's JSON
    answer to it."""
    rollout_id = store.enqueue({"question": "?"})
    task = store.try_claim()
    assert task is not None and task.attempt_id is not None
    call = Call(0, 0.0, rollout_id, task.attempt_id)
    call.kind, call.path, call.max_tokens = "chat", "/v1/chat/completions", 3
    call.capture = Capture("chat")
    answer = {
        "model": "m",
        "prompt_token_ids": prompt,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "yes"},
                "finish_reason": "length",
                "token_ids": ids,
                "logprobs": {"content": [{"token": "x", "logprob": -0.5, "top_logprobs": []} for _ in ids]},
            }
        ],
    }
    return call, orjson.dumps(answer)


def _finished(store: TaskStore, call: Call) -> list[LLMCall]:
    assert call.rollout_id is not None
    store.submit_result(Rollout(rollout_id=call.rollout_id, attempt_id=call.attempt_id, final_reward=1.0))
    return store.record(call.rollout_id).calls


def test_the_recorder_alone_records_once_through_the_store_view_and_counts_what_it_cannot() -> None:
    store, meters = TaskStore(vocab_size=1000), Meters(Registry())
    recorder = Recorder(store, meters, Sessions())
    call, body = _answered_call(store, [5, 6, 7], [1, 2])
    assert recorder.capture_body(call, 200, body) and call.capture is not None and call.capture.model == "m"
    recorder.commit(call)
    recorder.commit(call)  # once only
    recorder.finish(call)
    assert [
        (c.prompt_token_ids, c.response_token_ids, c.logprobs, c.limit) for c in _finished(store, call)
    ] == [([1, 2], [5, 6, 7], [-0.5, -0.5, -0.5], "max_tokens")]
    assert meters.calls.value("ok") == 1 and meters.generated.value() == 3

    bad, body = _answered_call(store, [5, 10_000], [1])  # an id past the vocabulary: recorded as none
    recorder.capture_body(bad, 200, body)
    recorder.finish(bad)
    assert [c.response_token_ids for c in _finished(store, bad)] == [None] and meters.no_ids.value() == 1

    late, body = _answered_call(store, [5], [1])
    recorder.capture_body(late, 200, body)
    _finished(store, late)  # the attempt ended before its call did: the store keeps nothing more
    recorder.finish(late)
    assert meters.unrecorded.value() == 1 and store.record(late.rollout_id or "").calls == []

    garbled, _ = _answered_call(store, [5], [1])
    assert not recorder.capture_body(garbled, 200, b'{"choices": [')  # not JSON: the call fails, says why
    assert garbled.error == "backend answered 200 with a body that is not JSON"


# ---------------------------------------------------------------------------------------------- capture
def _assembled(capture: Capture) -> list[tuple[object, object, object, object]]:
    return [(i, c.prompt_ids, ids, lps) for i, c, ids, lps in capture.result()]


@pytest.mark.parametrize("name", ["chat_stream", "chat_stream_n2_logprobs", "completion_stream"])
def test_capture_takes_reads_of_whole_events_as_it_takes_bytes_cut_anywhere(name: str) -> None:
    case = CASES[name]
    kind = "chat" if "chat" in case.path else "completion"
    events = [e + b"\n\n" for e in case.response.split(b"\n\n") if e.strip()]
    cut_anywhere, one_by_one, in_reads = Capture(kind), Capture(kind), Capture(kind)
    for i in range(0, len(case.response), 7):
        cut_anywhere.feed(case.response[i : i + 7])
    for event in events:
        one_by_one.take_events(event)
    for i in range(0, len(events), 3):  # three events a read: decoded together
        in_reads.take_events(b"".join(events[i : i + 3]))
    assert cut_anywhere.done and one_by_one.done and in_reads.done and not in_reads.broken
    assert _assembled(one_by_one) == _assembled(in_reads) == _assembled(cut_anywhere)
    assert all(ids for _, _, ids, _ in _assembled(in_reads))


def test_capture_of_a_read_with_a_garbled_event_is_broken_and_still_sees_the_abort_after_it() -> None:
    capture = Capture("chat")
    good = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[5],"finish_reason":null}]}\n\n'
    garbled = b'data: {"choices":[{"index":0,"delta":\n\n'
    aborted = (
        b'data: {"choices":[{"index":0,"delta":{"content":""},"token_ids":[],"finish_reason":"abort"}]}\n\n'
    )
    capture.take_events(good + garbled + aborted + b"data: [DONE]\n\n")
    assert capture.broken and capture.aborted and capture.done
    assert _assembled(capture) == [(0, None, None, None)]  # ids from a broken stream are never reported


def test_capture_of_a_read_with_an_event_holding_two_values_is_broken_as_that_event_alone_is() -> None:
    # An event whose data is "{...}, {...}" is not JSON; decoding a read's events as one array must not let it
    # pass as two events.
    first = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[5]}]}\n\n'
    two = b'data: {"choices":[{"index":0,"delta":{"content":"b"},"token_ids":[6]}]}, {"model":"m"}\n\n'
    alone, in_a_read = Capture("chat"), Capture("chat")
    alone.take_events(first)
    alone.take_events(two)
    in_a_read.take_events(first + two)
    assert alone.broken and in_a_read.broken
    assert _assembled(alone) == _assembled(in_a_read) == [(0, None, None, None)]


def test_capture_reports_logprobs_only_as_one_number_per_id() -> None:
    def answer(logprobs: list[object]) -> bytes:
        entries = [{"token": "x", "logprob": v, "bytes": [120], "top_logprobs": []} for v in logprobs]
        choice = {
            "index": 0,
            "message": {"content": "xx"},
            "token_ids": [1, 2],
            "logprobs": {"content": entries},
        }
        return orjson.dumps({"choices": [choice]})

    for logprobs, expected in (
        ([-1, -0.5], [-1.0, -0.5]),  # an integer is a number: made a float
        ([-1.0, None], None),  # not a number: none recorded, ids kept
        ([-1.0, True], None),  # a boolean is not a log-prob
        ([-1.0], None),  # not one per id
    ):
        capture = Capture("chat")
        assert capture.take_body(answer(logprobs))
        [(_, _, ids, lps)] = capture.result()
        assert ids == [1, 2] and lps == expected and all(type(v) is float for v in lps or ())


@pytest.mark.parametrize(
    ("ids", "logprobs"),
    [
        ([1, 2], [-1.0, -0.5]),
        ([1, 2], [-1, -0.5]),
        ([1, 2], [-1.0, None]),
        ([1, 2], [-1.0, True]),
        ([1, 2.0], [-1.0, -0.5]),
        ([1, True], [-1.0, -0.5]),
        ([1, -1], [-1.0, -0.5]),
        ([1, 2**63], [-1.0, -0.5]),
        ([1, 2**63 - 1], [-1.0, -0.5]),
        ([1, 999], [-1.0, -0.5]),
        ([1, 1000], [-1.0, -0.5]),
        ([1, "2"], [-1.0, -0.5]),
        ([1, [2]], [-1.0, -0.5]),
        (7, [-1.0]),
        ([], []),
    ],
)
def test_capture_checks_ids_and_logprobs_as_checked_token_ids_does_whichever_decoder_reads_them(
    ids: object, logprobs: list[object]
) -> None:
    """The checked decoder (ids typed as token ids, log-probs as numbers) and the fallback for what it refuses
    record the same: each id list as :func:`checked_token_ids` judges it (the vocabulary's bound too), log-probs
    only as one float per id; whole or streamed, a later event that the checked decoder refuses included."""
    from aglverl.models import checked_token_ids

    def recorded(capture: Capture) -> tuple[object, object]:  # as the recorder takes a choice
        [(_, _, got, lps)] = capture.result()
        checked = capture.token_ids(got, 1000)
        return checked, lps if checked is not None else None

    def expected(ids: object, logprobs: list[object]) -> tuple[object, object]:
        checked = checked_token_ids(ids, 1000)
        numbers = all(type(v) in (int, float) for v in logprobs)
        if checked is None or len(logprobs) != len(checked) or not numbers:
            return checked, None
        return checked, [float(v) for v in logprobs]

    def entries(logprobs: list[object]) -> dict[str, object]:
        return {
            "content": [{"token": "x", "logprob": v, "bytes": [120], "top_logprobs": []} for v in logprobs]
        }

    choice = {"index": 0, "message": {"content": "xx"}, "token_ids": ids, "logprobs": entries(logprobs)}
    whole = Capture("chat")
    assert whole.take_body(orjson.dumps({"prompt_token_ids": ids, "choices": [choice]}))
    assert recorded(whole) == expected(ids, logprobs)
    assert whole.token_ids(whole.prompt_ids, 1000) == checked_token_ids(ids, 1000)

    first = {"index": 0, "delta": {"content": "a"}, "token_ids": [3], "logprobs": entries([-0.25])}
    later = {"index": 0, "delta": {"content": "b"}, "token_ids": ids, "logprobs": entries(logprobs)}
    streamed = Capture("chat")
    streamed.take_events(
        b"".join(b"data: " + orjson.dumps({"choices": [c]}) + b"\n\n" for c in (first, later))
    )
    if isinstance(ids, list):
        assert recorded(streamed) == expected([3, *ids], [-0.25, *logprobs])
    else:  # not a list of ids at all: the stream's ids cannot be trusted
        assert streamed.broken and recorded(streamed) == (None, None)


def test_the_proxys_keywords_are_its_configs_fields_one_for_one() -> None:
    """``ProxySettings`` (the keywords of ``LLMProxy``, and ``AgentDaemon``'s through ``ProxyPolicySettings``)
    names each field of ``ProxyConfig`` once, and the old names of renamed ones: a new setting is one field and
    its line there, in one module."""
    from aglverl.proxy.config import ALIASES, PROXY_FIELDS, ProxySettings

    assert ProxySettings.__optional_keys__ == PROXY_FIELDS | ALIASES.keys()
