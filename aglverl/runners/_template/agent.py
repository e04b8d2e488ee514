"""The agent's process, forked by its supervisor: its group, signals, streams, directory, limits and environment,
then the program exec'd or the agent run in place. Stdlib only."""

from __future__ import annotations

import os
import resource
import signal
import sys

from .preload import report_imports
from .wire import traceback

_LIMITS = {
    "as": "RLIMIT_AS",
    "core": "RLIMIT_CORE",
    "cpu": "RLIMIT_CPU",
    "data": "RLIMIT_DATA",
    "fsize": "RLIMIT_FSIZE",
    "memlock": "RLIMIT_MEMLOCK",
    "nofile": "RLIMIT_NOFILE",
    "nproc": "RLIMIT_NPROC",
    "stack": "RLIMIT_STACK",
}


def become_agent(request: dict, fds: list[int], close: list[int], run, err_w: int, report_w: int) -> None:
    """In the forked agent process: set it up (:func:`_set_up`), then exec the program (``run`` is ``None``) or
    run the agent in place. A start that fails says why on ``err_w`` (exit 127). Never returns."""
    try:
        argv = _set_up(request, fds, close, run)
    except BaseException as exc:  # the start failed: say why on the error pipe
        why = (
            str(exc) if isinstance(exc, OSError) and exc.errno is not None else f"{type(exc).__name__}: {exc}"
        )
        os.write(err_w, why.encode(errors="replace")[:2000])
        os._exit(127)
    os.close(err_w)
    reseed()
    os._exit(_run_in_place(run, argv, report_w) & 0xFF)


def reseed() -> None:
    """Reseed from the OS the generators a fork shares with its template's every other fork, as far as they can be
    found: numpy's global generator (``numpy.random.seed``: what ``np.random.random()`` and the other legacy
    functions draw from; only if ``numpy.random`` was imported: numpy imports it lazily) and torch's default
    generators (``torch.manual_seed``: the CPU one, and CUDA's once initialized; only if torch was imported).
    Nothing is imported to reseed it. Python's ``random`` needs nothing: Python reseeds its global generator in
    every ``os.fork`` child itself. Generator objects the agent's code made (a module-level ``random.Random()``,
    ``np.random.default_rng()``, ``torch.Generator()``) are its own: they stay as the template made them (seed
    them from ``AGL_SEED``). A failure leaves the generator as it was (the agent runs all the same)."""
    entropy = os.urandom(24)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        try:
            numpy_random.seed([int.from_bytes(entropy[i : i + 4], "little") for i in range(0, 16, 4)])
        except Exception:
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            torch.manual_seed(int.from_bytes(entropy[16:], "little"))
        except Exception:
            pass


def _set_up(request: dict, fds: list[int], close: list[int], run) -> list[str]:
    """The agent's own process group, default signal dispositions, standard streams (``fds``: stdin, output),
    working directory and limits; the other descriptors (``close``) closed; then the program exec'd (``run`` is
    ``None``: it does not return) or the request's environment and argv made the process's (returns argv)."""
    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)
    for signum in (
        signal.SIGCHLD,
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
    ):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler if run is not None else signal.SIG_DFL)
    if run is None:  # an exec'd program starts with the default dispositions, as from a shell
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    stdin, output = fds[0], fds[1]
    os.dup2(stdin, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    for fd in {*fds, *close}:
        if fd > 2:
            try:
                os.close(fd)
            except OSError:
                pass
    os.chdir(request["cwd"])
    for name, value in (request.get("limits") or {}).items():
        which = getattr(resource, _LIMITS[name])
        hard = resource.getrlimit(which)[1]
        value = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
        resource.setrlimit(which, (value, value))
    env = request["env"]
    argv = request["argv"]
    if run is None:
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot run {argv[0]!r}: {os.strerror(exc.errno or 0)}") from None
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    return argv


def _run_in_place(run, argv: list[str], report_w: int) -> int:
    """Run the agent; its exit code (an exception's traceback goes to its log); then report what it imported."""
    code = 1
    try:
        run(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # the agent's error goes to its log, its exit code says it failed
        traceback().print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        try:
            report_imports(report_w)
        except BaseException:
            pass
    return code
