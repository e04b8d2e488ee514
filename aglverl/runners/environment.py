"""An attempt's own environment variables (Agent Lightning's contract, the SDKs' endpoints, the ``env_map``
fields), the variables a launcher passes on from the runner's environment, and safe file names for ids.

**Fields too large for the environment go by file.** The kernel refuses to start a program whose one
``NAME=value`` string passes :data:`ENV_STRING_MAX` bytes (Linux's ``MAX_ARG_STRLEN``, 128 KiB) or whose
environment and arguments together pass ``ARG_MAX`` (usually 2 MiB), and no environment variable can hold a
NUL byte. So an ``env_map`` field that would be refused (over the per-string limit, with a NUL byte, or, largest
first, past :data:`ENV_FIELDS_BUDGET` for the mapped fields together) is written to a file in the attempt's
private directory, and ``<NAME>_FILE`` names that file instead of ``<NAME>`` (the ``*_FILE`` convention of
container images); the attempt's log starts with a line saying which fields went so. The whole input is always
in ``AGL_INPUT_FILE`` and on standard input.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "ENV_FIELDS_BUDGET",
    "ENV_STRING_MAX",
    "AgentVariables",
    "agent_variables",
    "file_stem",
    "inherited",
]

#: The longest ``NAME=value`` string (with its NUL) the kernel passes to a program (``MAX_ARG_STRLEN``).
ENV_STRING_MAX = 32 * 4096
#: What the ``env_map`` fields may take of the environment together before the largest go by file.
ENV_FIELDS_BUDGET = 1 << 20

_SAFE = re.compile(r"[A-Za-z0-9_-]")


def file_stem(identifier: str) -> str:
    """A file name made from an id, never a path: every character but letters, digits, ``_`` and ``-`` is
    %-escaped (``/``, ``.``, anything outside ASCII), and a long result is cut and suffixed with a hash."""
    stem = (
        "".join(
            c if _SAFE.fullmatch(c) else "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass"))
            for c in identifier
        )
        or "%00"
    )
    if len(stem) > 160:
        stem = f"{stem[:120]}~{hashlib.sha256(identifier.encode(errors='surrogatepass')).hexdigest()[:16]}"
    return stem


def inherited(allow: Iterable[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) that ``allow`` names (names or shell patterns)."""
    environ = os.environ if environ is None else environ
    patterns = [p for p in allow if any(c in p for c in "*?[")]
    names = set(allow)
    return {
        k: v for k, v in environ.items() if k in names or any(fnmatch.fnmatchcase(k, p) for p in patterns)
    }


@dataclass
class AgentVariables:
    """An attempt's own variables, the files some ``env_map`` fields go in (name -> bytes), and the notice
    for its log saying so."""

    env: dict[str, str]
    files: dict[str, bytes] = field(default_factory=dict)
    notice: str = ""


def _env_bytes(name: str, value: str) -> bytes | None:
    """``NAME=value`` as the kernel gets it, or ``None`` when it cannot be an environment string at all."""
    try:
        data = f"{name}={value}".encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return None
    return None if b"\0" in data else data


def agent_variables(
    base: Mapping[str, str], fields: Mapping[str, str], scratch: str, *, budget: int = ENV_FIELDS_BUDGET
) -> AgentVariables:
    """``base`` (Agent Lightning's and the SDKs' variables) with the ``env_map`` ``fields``: each one as itself,
    or, when it cannot be an environment string or does not fit (see the module docstring), in a file of
    ``scratch`` named by ``<NAME>_FILE``."""
    env = dict(base)
    files: dict[str, bytes] = {}
    reasons: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for name, value in fields.items():
        data = _env_bytes(name, value)
        if data is None:
            reasons[name] = "has a NUL byte or cannot be encoded, which no environment variable can hold"
        elif len(data) + 1 > ENV_STRING_MAX:
            reasons[name] = (
                f"is {len(data) - len(name) - 1:,} bytes, over the {ENV_STRING_MAX - len(name) - 2:,} one "
                "environment variable may hold"
            )
        else:
            sizes[name] = len(data) + 1
    total = sum(sizes.values())
    for name in sorted(sizes, key=sizes.__getitem__, reverse=True):
        if total <= budget:
            break
        size = sizes.pop(name)
        total -= size
        reasons[name] = (
            f"is {size - len(name) - 2:,} bytes, and the fields together were over the {budget:,} bytes they may "
            "take of the environment"
        )
    for name, value in fields.items():
        if name in reasons:
            path = os.path.join(scratch, f"{name}.field")
            files[path] = value.encode("utf-8", "surrogatepass")
            env[f"{name}_FILE"] = path
            env.pop(name, None)
        else:
            env[name] = value
    notice = "".join(
        f"aglverl: {name} {why}: it is in the file named by {name}_FILE (the whole task input is in AGL_INPUT_FILE "
        "and on standard input)\n"
        for name, why in reasons.items()
    )
    return AgentVariables(env, files, notice)
