"""Agents as processes: aglverl's built-in runner, a process per rollout attempt, as Agent Lightning's
``runner_type=local`` runs them, and the launchers that start those processes.

- :mod:`.attempts` — :class:`ProcessRunner`: claims attempts from the daemon's store as they are queued (no
  polling), ``concurrency`` at once, and turns each process's end into the attempt's result; nothing an attempt
  does can stop it.
- :mod:`.seam` — the :class:`Launcher` protocol (``serve``, ``environment``, ``start``, ``stop``): what starts and
  ends an attempt's process. Its two implementations: :mod:`.forkserver` (:class:`ForkServer`: a Python agent
  imported once by a template process, each attempt a fork of it, in milliseconds) and :mod:`.spawn`
  (:class:`Spawner`: a new program, or a new Python, per attempt). A container launcher would be one more class.
- :mod:`.template` and :mod:`._template` — the template process and the supervisor of an attempt (a child
  subreaper: every process an agent starts is ended with its attempt, ``SIGTERM`` first, ``SIGKILL`` after the
  grace period, even one that left its process group; forked ahead of its attempt, and for a spawned program
  kept for the next one once nothing of the last is left), the runner's side and the template's (a package of
  its own, stdlib only, which the agent's Python loads from its folder); :mod:`.supervised` — an attempt's
  process as its supervisor reports it, every wait for its answers bounded: a supervisor its agent stopped or
  traced is ended by the runner, with every process of the attempt.
- :mod:`.options` — :class:`ProcessOptions` (the ``aglverl.processes`` section), :func:`resolve_env_map`,
  :func:`default_concurrency`; :mod:`.environment` — the attempt's variables (fields too large for the
  environment go by file), the allow-list of the runner's variables, file names from ids; :mod:`.logs` — the
  capped log of an attempt; :mod:`.checks` — :func:`check_agent`, before a run starts.

What an attempt's process gets: Agent Lightning's environment (``AGL_EVENT_URL`` =
``{server}/api/rollouts/{id}/attempt/0/events`` on the task server, ``AGL_KEY``: a key of its own that opens only
its rollout's paths, revoked once its process is gone; ``AGL_OPENAI_BASE_URL``: when the proxy runs on the
daemon's loop (no proxy shards), the attempt's own URL on the proxy,
``{proxy}/rollout/{rollout_id}/attempt/{attempt_id}/v1``, which its key opens and which does what Agent
Lightning's proxy path did (:mod:`aglverl.proxy.gateway`: the served model's name and the rollout's temperature
set), so that a call is one HTTP exchange; else that path on the task server,
``{server}/proxy/rollout/{id}/attempt/0/mode/{train|val}/openai/v1``), the same endpoints and key in the
variables the SDKs read (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL`` (without ``/v1``),
``ANTHROPIC_API_KEY``), ``AGL_ROLLOUT_ID``, ``AGL_ATTEMPT_ID``, ``AGL_MODE``, ``AGL_MODEL``
(the served model's name), ``AGL_SEED`` (a fresh 32-bit seed, the first line of its log), the task input as
JSON on its standard input and in the file ``AGL_INPUT_FILE``, the
input's fields named by ``env_map`` (Agent Lightning's ``local.env_map``), and of the runner's own environment
only the variables ``env_allow`` names (no secrets by default). The ``{id}`` is the attempt's Agent Lightning
rollout id (:mod:`aglverl.agl10.rollouts`: attempt ``k > 1`` of rollout ``R`` is ``R-retry-<k-1>``).

The reward: the value of the attempt's last ``reward`` event, or a number written to ``AGL_REWARD_FILE``, or
``reward_fillna_value`` when set. The processes' standard output and error go to ``<log_dir>/<id>.log`` (the id
%-escaped: never a path), at most ``log_max_bytes`` of it.
"""

from __future__ import annotations

from .attempts import ProcessRunner
from .checks import check_agent
from .forkserver import ForkServer
from .options import AGENT_CLASS_SHIM, DEFAULT_ENV_ALLOW, ProcessOptions, default_concurrency, resolve_env_map
from .seam import AgentExit, AgentProcess, Launch, Launcher, LaunchFailed
from .spawn import Spawner

__all__ = [
    "AGENT_CLASS_SHIM",
    "DEFAULT_ENV_ALLOW",
    "AgentExit",
    "AgentProcess",
    "ForkServer",
    "Launch",
    "LaunchFailed",
    "Launcher",
    "ProcessOptions",
    "ProcessRunner",
    "Spawner",
    "check_agent",
    "default_concurrency",
    "resolve_env_map",
]
