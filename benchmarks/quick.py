"""Every benchmark's quick mode, one after the other: what CI runs so that no benchmark rots unseen.

Run: ``python benchmarks/quick.py [--only NAME ...] [--heavy]``. Prints ONE JSON object: per benchmark its
command, seconds, and whether it ended well (exit 0 and one JSON object on stdout, or a JSON line last); exits 1
when any did not, with the end of its output. Each runs in a child process with ``QUICK_TIMEOUT`` seconds.

The light benchmarks (the proxy, the daemon, the store, the batch, the embedded engine against mocks) run their
own code end to end on a miniature load: a few calls, one level, one block, a second or two each. The heavy ones
(``HEAVY``: each starts Ray and verl's trainer, ~30 s before its first step, or needs Agent Lightning's venv)
are run only with ``--heavy``: their quick modes take minutes together, more than CI's budget (2 minutes for all
of these).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
#: Seconds one benchmark's quick mode may take.
QUICK_TIMEOUT = 120.0

#: (name, the script and its arguments): the light benchmarks' quick modes, run by default.
LIGHT: list[tuple[str, list[str]]] = [
    ("batch_build", ["batch_build.py", "--quick"]),
    ("proxy_libraries", ["proxy_libraries.py", "--quick"]),
    ("turnaround", ["turnaround.py", "--steps", "3", "--warmup", "1", "--agents", "4", "--rollouts", "8"]),
    ("proxy", ["proxy.py", "--quick"]),
    ("proxy_capacity", ["proxy_capacity.py", "--quick", "--max-seconds", "4"]),
    ("proxy_overload", ["proxy_overload.py", "--quick"]),
    ("proxy_memory", ["proxy_memory.py", "--clients", "8", "--body-mib", "4"]),
    ("control_plane", ["control_plane.py", "--quick"]),
    ("soak", ["soak.py", "--quick"]),
    ("inference", ["inference.py", "--quick"]),
    ("constrained", ["constrained.py", "--quick"]),
    ("multiturn", ["multiturn.py", "--quick"]),
]
#: The heavy ones (Ray and verl, or Agent Lightning's venv), with ``--heavy``.
HEAVY: list[tuple[str, list[str]]] = [
    ("training", ["training.py", "--variants", "sync", "--runs", "1", "--steps", "2", "--warmup", "0"]),
    ("readme_snippet", ["readme_snippet.py", "--steps", "2"]),
    ("rejection_sampling", ["rejection_sampling.py", "--steps", "2", "--repeats", "1"]),
    ("checkpoint_engine", ["checkpoint_engine.py", "--sizes", "tiny", "--repeats", "1"]),
    ("proxy_shards", ["proxy_shards.py", "--quick", "--max-seconds", "20"]),
    ("agent_processes", ["agent_processes.py", "--rollouts", "4", "--concurrency", "2", "--starts", "1"]),
    (
        "soak_training",
        ["soak.py", "--training", "--steps", "4", "--kill-every", "2", "--save-freq", "2", "--mode", "sync"],
    ),
]


def one_json(stdout: bytes) -> bool:
    """Whether a benchmark's output is one JSON object (or ends with a JSON line, as the child-driving ones)."""
    text = stdout.strip()
    if not text:
        return False
    for candidate in (text, text.splitlines()[-1]):
        try:
            if isinstance(orjson.loads(candidate), dict):
                return True
        except orjson.JSONDecodeError:
            continue
    return False


def run(name: str, argv: list[str]) -> dict[str, object]:
    command = [sys.executable, str(HERE / argv[0]), *argv[1:]]
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, capture_output=True, timeout=QUICK_TIMEOUT, cwd=HERE.parent, check=False
        )
        ok = done.returncode == 0 and one_json(done.stdout)
        tail = "" if ok else (done.stdout[-1500:] + b"\n" + done.stderr[-3000:]).decode("utf-8", "replace")
        code: int | None = done.returncode
    except subprocess.TimeoutExpired as exc:
        ok, code = False, None
        tail = f"timed out after {QUICK_TIMEOUT:g}s\n" + ((exc.stderr or b"")[-3000:]).decode(
            "utf-8", "replace"
        )
    out: dict[str, object] = {
        "command": " ".join(argv),
        "seconds": round(time.monotonic() - started, 1),
        "ok": ok,
    }
    if not ok:
        out |= {"exit": code, "tail": tail}
    print(f"{name}: {'ok' if ok else 'FAILED'} in {out['seconds']} s", file=sys.stderr, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="these benchmarks only (their names above)")
    parser.add_argument("--heavy", action="store_true", help="also the heavy ones (Ray and verl; minutes)")
    args = parser.parse_args()
    chosen = LIGHT + (HEAVY if args.heavy else [])
    if args.only:
        chosen = [(name, argv) for name, argv in LIGHT + HEAVY if name in args.only]
    started = time.monotonic()
    results = {name: run(name, argv) for name, argv in chosen}
    failed = [name for name, result in results.items() if not result["ok"]]
    report = {
        "benchmark": "every benchmark's quick mode",
        "results": results,
        "failed": failed,
        "seconds": round(time.monotonic() - started, 1),
        "loadavg": list(os.getloadavg()),
    }
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
