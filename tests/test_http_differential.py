"""The proxy's HTTP server against a reference on llhttp: aiohttp's server (its C parser, llhttp with aiohttp's
limits), on a corpus of a few hundred raw requests generated here.

Each case is bytes written to a socket, whole, cut in pieces or dribbled a few bytes at a time: framings
(``Content-Length`` of every spelling, chunked bodies of every shape, both, neither), heads (versions, line ends,
header counts and lengths, control bytes, duplicates, folding, whitespace), targets (queries, fragments,
escapes, absolute form) and pipelined requests. The same bytes go to the reference, an aiohttp echo server that
answers each request with what it received (method, path, query, the ``X-`` headers, the body), and to the
proxy in front of that same echo server (each target under a claimed attempt's route,
``/rollout/{id}/attempt/{id}/v1/...``: admitted, then relayed as it came). For every
case the answers must agree: the same number, each accepted by both (and then the echo server received the same
request through the proxy as directly) or refused by both (the statuses may differ: the proxy names the limit,
431 where aiohttp says 400; a reference that resets the connection instead of answering, as aiohttp's does when it
refuses a head that is still arriving, refused it). The few places where the proxy answers otherwise on purpose
are listed in :data:`DELIBERATE`, each with its reason.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import orjson
import pytest
from aiohttp import web
from helpers.raw_http import split_answer

from aglverl._net import HttpListener
from aglverl.metrics import Registry
from aglverl.proxy import LLMProxy, RetryPolicy
from aglverl.store import TaskStore

pytestmark = pytest.mark.anyio

#: Bound, in seconds, on each case's exchange with one server (with the reference, once the proxy refused).
WAIT = 2.0
SILENT_WAIT = 0.3


# ---------------------------------------------------------------------------------------------- the servers
async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    path = request.path
    if path.startswith("/rollout/"):  # the reference's: what the proxy sends upstream is from /v1 on
        path = "/" + path.split("/", 5)[5]
    seen = {
        "method": request.method,
        "path": path,
        "query": request.rel_url.raw_query_string,
        "x": sorted((k.lower(), v) for k, v in request.headers.items() if k.lower().startswith("x-")),
        "body": body.decode("latin-1"),
    }
    return web.Response(body=orjson.dumps(seen), content_type="application/json")


@asynccontextmanager
async def servers() -> AsyncIterator[tuple[str, str, bytes]]:
    """The reference (an aiohttp echo server) and the proxy in front of it (their ``host:port``), and the path
    prefix of an attempt claimed in the proxy's store (``/rollout/{id}/attempt/{id}``)."""
    app = web.Application(client_max_size=1 << 20)
    app.router.add_route("*", "/{tail:.*}", _echo)
    echo = HttpListener(app, "127.0.0.1", 0)
    url = await echo.start()
    try:
        store = TaskStore(lease_seconds=3600)
        store.enqueue({"q": 1})
        task = store.try_claim()
        assert task is not None
        prefix = f"/rollout/{task.rollout_id}/attempt/{task.attempt_id}".encode()
        proxy = LLMProxy(
            store,
            backends=[url],
            registry=Registry(),
            retry=RetryPolicy(attempts=1),
            max_body_bytes=1 << 20,
        )
        async with anyio.create_task_group() as tg:
            await tg.start(proxy.serve)
            yield url.removeprefix("http://"), proxy.url.removeprefix("http://"), prefix
            tg.cancel_scope.cancel()
    finally:
        await echo.stop()


# ---------------------------------------------------------------------------------------------- the corpus
@dataclass(frozen=True)
class Case:
    """Raw bytes and how they are written (``piece``: bytes per write, 0 for one write)."""

    name: str
    data: bytes
    piece: int = 0
    head_only: bool = False  # the answers are to HEAD requests: no bodies


def req(
    target: str = "/v1/echo",
    *,
    method: str = "POST",
    version: str = "HTTP/1.1",
    headers: tuple[str, ...] = ("Host: h",),
    body: bytes | None = b"{}",
    close: bool = True,
) -> bytes:
    """A request: request line, ``headers``, a ``Content-Length`` of ``body`` (``None``: no length, no body)
    and ``Connection: close`` (the last request of a case: both servers then close after answering it)."""
    lines = [f"{method} {target} {version}", *headers]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def chunks(body: bytes, size: int, ext: str = "", trailer: str = "") -> bytes:
    pieces = [body[i : i + size] for i in range(0, len(body), size)] if size else []
    out = b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext.encode(), p) for p in pieces)
    return out + b"0\r\n" + (trailer.encode() + b"\r\n" if trailer else b"") + b"\r\n"


def framing() -> Iterator[Case]:
    body = b'{"k": "' + b"v" * 300 + b'"}'
    for length in ("2", "02", "+2", "-2", " 2", "2 ", "2\t", "0x2", "2.0", "1e0", "", "99999999999999999999"):
        yield Case(
            f"cl[{length!r}]", req(headers=("Host: h", f"Content-Length: {length}"), body=None) + b"{}"
        )
    for pad in ("\x0b", "\x0c", "\x00", "\x01"):
        yield Case(f"cl-pad[{pad!r}]", req(headers=("Host: h", f"Content-Length: {pad}2"), body=None) + b"{}")
    yield Case(
        "cl-two-same", req(headers=("Host: h", "Content-Length: 2", "Content-Length: 2"), body=None) + b"{}"
    )
    yield Case(
        "cl-two-differ", req(headers=("Host: h", "Content-Length: 2", "Content-Length: 3"), body=None) + b"{}"
    )
    yield Case("cl-list", req(headers=("Host: h", "Content-Length: 2, 2"), body=None) + b"{}")
    for size, ext, trailer in itertools.product((1, 7, 64, 1000), ("", ";a=b"), ("", "X-Trailer: t")):
        name = f"chunked[{size},{ext!r},{trailer!r}]"
        yield Case(
            name,
            req(headers=("Host: h", "Transfer-Encoding: chunked"), body=None)
            + chunks(body, size, ext, trailer),
        )
    for te in (
        "chunked",
        "Chunked",
        "CHUNKED",
        "ChUnKeD",
        "gzip, chunked",
        "chunked, gzip",
        "identity",
        "chunked, chunked",
        " chunked",
    ):
        head = req(headers=("Host: h", f"Transfer-Encoding: {te}"), body=None)
        yield Case(f"te[{te!r}]", head + chunks(b"{}", 1))
    for name in ("transfer-encoding", "TRANSFER-ENCODING", "tRaNsFeR-eNcOdInG"):
        yield Case(
            f"te-name[{name}]", req(headers=("Host: h", f"{name}: chunked"), body=None) + chunks(body, 50)
        )
    yield Case(
        "te-and-cl",
        req(headers=("Host: h", "Transfer-Encoding: chunked", "Content-Length: 5"), body=None)
        + chunks(b"{}", 1),
    )
    yield Case(
        "te-two",
        req(headers=("Host: h", "Transfer-Encoding: gzip", "Transfer-Encoding: chunked"), body=None)
        + chunks(b"{}", 1),
    )
    for size in ("2 ", "2\t", "+2", "0x2", "-2", "g", "2;", "fffffffffffffffff"):
        data = (
            req(headers=("Host: h", "Transfer-Encoding: chunked"), body=None)
            + f"{size}\r\n{{}}\r\n0\r\n\r\n".encode()
        )
        yield Case(f"chunk-size[{size!r}]", data)
    yield Case(
        "chunk-no-crlf",
        req(headers=("Host: h", "Transfer-Encoding: chunked"), body=None) + b"2\r\n{}0\r\n\r\n",
    )
    yield Case(
        "chunk-lf-only", req(headers=("Host: h", "Transfer-Encoding: chunked"), body=None) + b"2\n{}\n0\n\n"
    )
    for method in ("GET", "DELETE", "OPTIONS", "PUT", "PATCH"):
        yield Case(f"method[{method}]", req(method=method, body=b"" if method == "GET" else body))
    yield Case("get-no-length", req(method="GET", body=None))
    yield Case("head", req(method="HEAD", body=None), head_only=True)


def heads() -> Iterator[Case]:
    for version in (
        "HTTP/1.1",
        "HTTP/1.0",
        "HTTP/1.2",
        "HTTP/2.0",
        "HTTP/0.9",
        "http/1.1",
        "HTTP/1",
        "HTTP/1.10",
    ):
        yield Case(f"version[{version}]", req(version=version))
    yield Case("http-1.0-no-host", req(version="HTTP/1.0", headers=()))
    yield Case("no-host", req(headers=()))
    yield Case("two-hosts", req(headers=("Host: a", "Host: b")))
    yield Case("empty-host", req(headers=("Host:",)))
    for count in (10, 100, 126, 200, 1000):
        yield Case(f"lines[{count}]", req(headers=("Host: h", *(f"X-F{i}: {i}" for i in range(count)))))
    for size in (100, 4000, 8000, 9000, 60_000):
        yield Case(f"value[{size}]", req(headers=("Host: h", "X-Long: " + "v" * size)))
        yield Case(f"name[{size}]", req(headers=("Host: h", "X-" + "n" * size + ": v")))
    for byte in (0, 1, 8, 11, 12, 27, 127):
        yield Case(f"ctl-value[{byte}]", req(headers=("Host: h", f"X-C: a{chr(byte)}b")))
        yield Case(f"ctl-name[{byte}]", req(headers=("Host: h", f"X-C{chr(byte)}: ab")))
    yield Case("tab-in-value", req(headers=("Host: h", "X-T: a\tb")))
    yield Case("utf8-value", req(headers=("Host: h", "X-U: caf\xc3\xa9")))
    yield Case("latin1-value", req(headers=("Host: h", "X-L: caf\xe9")))
    yield Case("space-before-colon", req(headers=("Host: h", "X-S : v")))
    yield Case("no-colon", req(headers=("Host: h", "X-No-Colon")))
    yield Case("empty-name", req(headers=("Host: h", ": v")))
    yield Case("folded", req(headers=("Host: h", "X-Fold: a", " b")))
    yield Case("leading-space-line", req(headers=(" Host: h",)))
    yield Case("bare-lf", req().replace(b"\r\n", b"\n"))
    yield Case("bare-cr", req().replace(b"\r\n", b"\r"))
    yield Case("lf-head-end", req().replace(b"\r\n\r\n", b"\r\n\n"))
    yield Case("crlf-before", b"\r\n" + req())
    yield Case("two-content-types", req(headers=("Host: h", "Content-Type: a/b", "Content-Type: c/d")))
    yield Case("two-x", req(headers=("Host: h", "X-A: 1", "X-A: 2")))
    yield Case("expect-100", req(headers=("Host: h", "Expect: 100-continue")))
    yield Case("expect-other", req(headers=("Host: h", "Expect: teapot")))
    for method in ("FOO", "get", "G ET", "CONNECT", "TRACE", "PRI"):
        yield Case(f"method[{method}]", req(method=method, body=None))


def targets() -> Iterator[Case]:
    for target in (
        "/v1/echo?x=1",
        "/v1/echo?x=1&y=%20",
        "/v1/echo#frag",
        "/v1/echo?x=1#frag",
        "/v1/ech%6F",
        "/v1/a%2Fb",
        "/v1/a%20b",
        "/v1/a%zzb",
        "/v1/a%",
        "/v1//echo",
        "/v1/echo/",
        "/v1/a;b=c",
        "/v1/a@b:c",
        "/v1/~user",
        "http://h/v1/echo",
        "http://h:1/v1/echo?q#f",
        "*",
        "/v1/" + "p" * 5000,
        "/v1/" + "p" * 9000,
        "/v1/a\x7fb",
        "/v1/a\xc3\xa9",
        "/v1/a b",
        "/v1/a\tb",
        "v1/echo",
        "",
    ):
        yield Case(f"target[{target[:40]!r}]", req(target))


def pipelined() -> Iterator[Case]:
    first = req("/v1/one", close=False)
    chunked = req(
        "/v1/two", headers=("Host: h", "Transfer-Encoding: chunked"), body=None, close=False
    ) + chunks(b"{}", 1)
    get = req("/v1/three", method="GET", body=None, close=False)
    last = req("/v1/last")
    yield Case("pipe-2", first + last)
    yield Case("pipe-4", first + chunked + get + last)
    yield Case("pipe-10", first * 9 + last)
    yield Case("pipe-bad-middle", first + b"GARBAGE\r\n\r\n" + last)
    yield Case(
        "pipe-bad-head-middle", first + req("/v1/x", headers=("Host: h", "X: a\x01b"), close=False) + last
    )
    yield Case("pipe-after-close", req("/v1/one") + last)
    yield Case(
        "pipe-1.0-keep-alive",
        req("/v1/one", version="HTTP/1.0", headers=("Connection: keep-alive",), close=False) + last,
    )


def base_name(case: Case) -> str:
    """The name of the case a cut one was cut from (``name/7``: ``name``)."""
    return case.name.rsplit("/", 1)[0] if case.piece else case.name


def cut(cases: Iterator[Case], pieces: tuple[int, ...]) -> Iterator[Case]:
    for case in cases:
        for piece in pieces:
            yield Case(f"{case.name}/{piece}", case.data, piece, case.head_only)


def corpus() -> dict[str, list[Case]]:
    whole = {"framing": list(framing()), "heads": list(heads()), "targets": list(targets())}
    whole["pipelined"] = list(pipelined())
    some = [c for group in whole.values() for c in group if len(c.data) < 2000][::2]
    whole["dribbled"] = list(cut(iter(some), (1, 7))) + list(cut(pipelined(), (3, 50)))
    return whole


CORPUS = corpus()

#: Cases the proxy answers otherwise on purpose, and why (a case cut in pieces, ``name/7``, counts as its name).
DELIBERATE: dict[str, str] = {
    "version[HTTP/2.0]": "an HTTP/2.0 request line is not HTTP/1.1: 505 (aiohttp serves it as 1.1)",
    "version[HTTP/0.9]": "no version after the target is no request the proxy serves: 400",
    "te['gzip, chunked']": "a transfer coding the proxy does not decode: 501 (aiohttp passes the coded body on)",
    "te-two": "Transfer-Encoding twice: the proxy refuses a coding it does not decode (501), aiohttp the duplicate",
    "pipe-bad-middle": "the requests before a malformed one are answered; aiohttp answers none of them",
    "pipe-bad-head-middle": "the requests before a malformed one are answered; aiohttp answers none of them",
    "pipe-after-close": "the request with Connection: close is answered, what follows it dropped; aiohttp "
    "answers the whole a 400",
}


# ---------------------------------------------------------------------------------------------- exchange
def attributed(data: bytes, prefix: bytes) -> bytes:
    """``data`` with each target under ``/v1/`` moved under the attempt's ``prefix``: the agents' attributed
    route, the one each call is admitted on."""
    return data.replace(b" /v1/", b" " + prefix + b"/v1/").replace(b"://h/v1/", b"://h" + prefix + b"/v1/")


async def exchange(address: str, case: Case, prefix: bytes, wait: float = WAIT) -> bytes:
    """Write ``case`` (its targets under ``prefix``) to ``address`` and return all that comes back until the
    server closes (within ``wait``)."""
    data = attributed(case.data, prefix)
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        with anyio.fail_after(wait):
            if case.piece:
                for i in range(0, len(data), case.piece):
                    writer.write(data[i : i + case.piece])
                    await writer.drain()
                    await asyncio.sleep(0)
            else:
                writer.write(data)
                await writer.drain()
            return await reader.read(-1)
    except (ConnectionError, TimeoutError) as exc:
        return f"<{type(exc).__name__}>".encode()
    finally:
        writer.close()


def answers(raw: bytes, head_only: bool) -> list[tuple[int, object]]:
    """The answers in ``raw``: ``(status, what the echo server received)`` for an accepted request, ``(status,
    None)`` for a refusal; a trailing ``<Error>`` marks a connection reset or a timeout."""
    out: list[tuple[int, object]] = []
    while raw:
        if raw.startswith(b"<"):
            out.append((0, raw.decode()))
            break
        status, _, body, raw = split_answer(raw, head_only)
        if status != 100:
            out.append((status, orjson.loads(body) if status == 200 and body else None))
    return out


def verdict(answers: list[tuple[int, object]]) -> list[tuple[str, object]]:
    """What a case comes to, for comparison: per answer, "ok" and what the echo server received, or "refused"
    (a connection reset or timed out instead of an answer counts as a refusal)."""
    return [("ok", seen) if 0 < status < 400 else ("refused", None) for status, seen in answers]


async def differences(group: str) -> tuple[list[str], int]:
    found: list[str] = []
    async with servers() as (reference, proxy, prefix):
        for case in CORPUS[group]:
            mine = answers(await exchange(proxy, case, prefix), case.head_only)
            got = verdict(mine)
            # aiohttp's server never answers some malformed chunked bodies that come a byte at a time: where the
            # proxy refused, its silence is the same verdict, and it is not waited for long
            wait = SILENT_WAIT if all(v == "refused" for v, _ in got) else WAIT
            theirs = answers(await exchange(reference, case, prefix, wait), case.head_only)
            want = verdict(theirs)
            if want != got and base_name(case) not in DELIBERATE:
                found.append(f"{case.name}: aiohttp {theirs} vs proxy {mine}")
    return found, len(CORPUS[group])


@pytest.mark.parametrize("group", sorted(CORPUS))
async def test_the_proxy_answers_the_corpus_as_the_reference_server_does(group: str) -> None:
    found, total = await differences(group)
    assert not found, f"{len(found)} of {total} {group} cases differ:\n" + "\n".join(found)


def test_the_corpus_holds_a_few_hundred_requests() -> None:
    assert 300 <= sum(len(group) for group in CORPUS.values()) <= 1000
    assert all(name in {base_name(c) for g in CORPUS.values() for c in g} for name in DELIBERATE)
