"""The template process and the per-attempt supervisor, run by the agent's own Python: stdlib only.

aglverl's runner never imports this module: it reads this file's text and starts ``python -c <text> <fd> <kind>
<spec>...`` (:mod:`aglverl.runners.template`), so it runs in whatever Python the agent uses (3.8 or later, with or
without aglverl installed). One process of it is a **template**:

- it prepares once what every attempt of its agent needs (``kind``): ``bare`` nothing (the plain spawn execs a
  program); ``class`` imports an Agent Lightning agent class's module, and the modules the class's body imports
  (an ``import openai`` inside ``run()`` costs nothing per attempt either); ``script`` / ``module`` / ``code``
  (``python script.py``, ``python -m module``, ``python -c code``) imports what the script imports at its top
  level. Imports that fail are left for the attempt to fail on;
- it answers ``{"ready": ...}`` on its control socket (fd ``<fd>``), or ``{"error": ...}`` and exits;
- then, for each fork request (a JSON line and three descriptors: the attempt's stdin, its output, and its
  channel to the runner), it checks that the agent's files have not changed (else ``{"stale": path}`` and it
  exits: the runner starts a fresh template) and that it runs no thread (else ``{"threads": n}``: forking a
  process with threads can deadlock the child), forks a **supervisor** and answers ``{"forked": pid}``. A
  request ``{"spare": true}`` comes with one descriptor (the channel): its supervisor sets itself up and waits
  for its attempt on the channel (the request line, its first byte carrying the stdin and output), so that a
  spawner starts an attempt with one message instead of a fork;
- it is a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): a process orphaned by a supervisor that died
  (killed by its agent) is reparented to the template, which kills it;
- it exits when the runner closes its control socket.

A **supervisor** (of one attempt at a time) starts a session of its own, becomes a child subreaper, and forks the
agent's process: in a process group of its own, with the attempt's environment, working directory, standard
streams and resource limits, running the agent in place (``class`` and the Python kinds: no new interpreter,
nothing imported again) or exec'ing the program (``bare``). Every process the agent starts stays in the
supervisor's tree, even one that left the agent's process group or session (``setsid``, a double fork): when
its parent dies it is reparented to the supervisor. The supervisor reports on the attempt's channel
(newline-delimited JSON): ``{"started": pid}`` or ``{"failed": why}``, then ``{"exited": {"code"|"signal":
n}}`` when the agent's process ends, then ``{"done": {"cpu_s": x, "strays": n, "result": text}}`` once no
process of the attempt is left (``result``: the first bytes of the request's ``result_file``, the reward file,
read then: ``""`` when it is not a regular file; the runner needs no thread to read it). Whatever way the agent's process ends, what it left behind gets ``SIGTERM`` and, after the
grace period, ``SIGKILL``. ``stop <grace>`` on the channel (or the channel closing: the runner is gone) does
the same to the agent's process and everything it started. Waiting is ``select`` on the channel and on the
``SIGCHLD`` wake-up pipe, with the grace period's deadline as the only timeout. Once done, a bare template's
supervisor (a spawned program's) says ``"waits": true`` in its ``done`` and waits on the same channel for its
next attempt, as a spare does (the runner keeps it, or closes the channel: it exits); a Python template's
supervisor exits, and so does one that could not kill all of its attempt's processes. A spare of a Python template checks the agent's files before it forks the agent (``{"failed": ...,
"stale": path}`` when one changed since it was forked).
"""

from __future__ import annotations

import builtins
import gc
import importlib
import json
import os
import resource
import select
import signal
import socket
import stat
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36
#: After the SIGKILL, how long a supervisor waits for its processes before it reports the ones left (a process
#: in uninterruptible sleep cannot be killed until it wakes).
_KILL_WAIT_SECONDS = 30.0
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


_LIBC: list = []  # the C library, loaded once (by the template; its forks find it loaded)


def _subreaper() -> bool:
    """Make this process a child subreaper (Linux 3.4+); False where the platform has no such thing."""
    try:
        if not _LIBC:
            import ctypes

            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        return int(_LIBC[0].prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _threads() -> int:
    """Threads in this process (the kernel's count: C libraries' threads included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _traceback():
    """The ``traceback`` module, imported when something failed (a bare template starts without it)."""
    import traceback

    return traceback


def _send(sock: socket.socket, *messages: dict) -> None:
    try:
        sock.sendall("".join(json.dumps(message) + "\n" for message in messages).encode())
    except OSError:
        pass  # the runner is gone; what it would have read no longer matters


def _wake_pipe() -> tuple[int, int]:
    """A pipe the kernel's SIGCHLD writes a byte to (``signal.set_wakeup_fd``): ``select`` wakes on it."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(w)
    return r, w


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


# ---------------------------------------------------------------------------------------------- preparing
def _imported_names(tree: ast.Module, agent_class: str | None = None) -> list[str]:  # noqa: F821 (imported inside)
    """Absolute module names the file imports at its top level (in ``if``, ``try``, ``with`` blocks too, but not
    in ``except`` handlers: fallbacks), and anywhere in the body of the class ``agent_class`` (its ``run()``'s
    imports), in order. Functions and other classes are left alone (a ``main()`` that imports a trainer)."""
    import ast  # here, not at the top: a bare template (the spawner's) never needs it

    nodes: list[ast.AST] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.ClassDef) and node.name == agent_class:
            nodes.extend(ast.walk(node))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            nodes.append(node)
        elif isinstance(node, (ast.If, ast.With, ast.AsyncWith)):
            todo[:0] = [*node.body, *getattr(node, "orelse", [])]
        elif isinstance(node, ast.Try):
            todo[:0] = [*node.body, *node.orelse, *node.finalbody]
    names: list[str] = []
    for found in nodes:
        if isinstance(found, ast.Import):
            names.extend(alias.name for alias in found.names)
        elif isinstance(found, ast.ImportFrom) and found.level == 0 and found.module:
            names.append(found.module)
            names.extend(f"{found.module}.{alias.name}" for alias in found.names if alias.name != "*")
    return names


def _preimport(source: str | None, skip: str | None = None, agent_class: str | None = None) -> None:
    """Import what a file imports (failures are the attempt's to meet: ignored here)."""
    if not source:
        return
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    for name in _imported_names(tree, agent_class):
        if name == skip or name == "__main__":
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # an import that fails or exits is the attempt's problem
            pass


def _source_of(module: str) -> str | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.loader is None or not hasattr(spec.loader, "get_source"):
        return None
    try:
        return spec.loader.get_source(module)
    except (ImportError, OSError):
        return None


def _run_class(cls: type) -> None:
    result = cls().run()
    if hasattr(result, "__await__"):
        import asyncio

        asyncio.run(result)


#: What nearly every agent imports at its first connection, whatever its HTTP client: the codec ``socket`` encodes
#: a host name with for ``getaddrinfo`` (and the modules it needs). Imported by each Python template, so that no
#: fork pays for it (~5 ms of CPU each) before the template has learned it from the first ones.
_NETWORKED = ("encodings.idna",)


def _prepare(kind: str, spec: list[str]):
    """What one attempt runs in its forked process, given its argv (``None`` for ``bare``: it execs)."""
    if kind == "bare":
        return None, []
    import importlib.util  # a Python agent's template (a bare one, the spawner's, imports what it needs alone)
    import runpy

    for name in _NETWORKED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if kind == "class":
        (path,) = spec
        module, sep, name = path.partition(":")
        if not sep:
            module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        if not isinstance(cls, type):
            raise TypeError(f"{path} is not a class")
        _preimport(_source_of(module), skip=module, agent_class=name)
        files = [getattr(sys.modules[module], "__file__", None)]
        return (lambda argv: _run_class(cls)), files
    if kind == "script":
        (path,) = spec
        sys.path[0] = os.path.dirname(os.path.abspath(path))
        with open(path, encoding="utf-8", errors="replace") as f:
            _preimport(f.read())
        return (lambda argv: runpy.run_path(path, run_name="__main__")), [path]
    if kind == "module":
        (name,) = spec
        sys.path[0] = os.getcwd()
        package = name.rpartition(".")[0]
        if package:
            importlib.import_module(package)
        source = _source_of(name)
        if source is None:
            raise ImportError(f"No module named {name!r} (or it has no source to run)")
        _preimport(source, skip=name)
        found = importlib.util.find_spec(name)
        return (lambda argv: runpy.run_module(name, run_name="__main__", alter_sys=True)), [
            found and found.origin
        ]
    if kind == "code":
        (code,) = spec
        _preimport(code)
        compiled = compile(code, "<string>", "exec")
        return (lambda argv: exec(compiled, {"__name__": "__main__", "__builtins__": builtins})), []
    raise ValueError(f"unknown template kind {kind!r}")


def _own_files(extra: list) -> dict[str, tuple[int, int]]:
    """The agent's own source files (its module or script, and every module imported from outside the
    interpreter's installation), with their modification time and size: a changed one makes the template stale."""
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix) if p}
    paths = {p for p in extra if p}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py"):
            continue
        real = os.path.realpath(path)
        if (
            "site-packages" in real
            or "dist-packages" in real
            or any(real.startswith(r + os.sep) for r in roots)
        ):
            continue
        paths.add(path)
    stamps = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        stamps[path] = (st.st_mtime_ns, st.st_size)
    return stamps


#: The agent's own files as the template imported them (its forks check them too: a spare, before its attempt).
_STAMPS: dict[str, tuple[int, int]] = {}


def _changed(stamps: dict[str, tuple[int, int]]) -> str | None:
    for path, stamp in stamps.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_mtime_ns, st.st_size) != stamp:
            return path
    return None


#: The modules the template has imported: what an agent imports beyond them is reported, for the template to
#: import before the next forks (an SDK's lazy imports at its first call are then paid once).
_KNOWN: set[str] = set()
_REPORT_MAX = 5000
#: How much of the result file a supervisor reads (``aglverl.runners.seam.RESULT_MAX``).
_RESULT_MAX = 256


def _report_imports(fd: int) -> None:
    """Write the names of the modules this agent imported that the template had not (one JSON list)."""
    names = [
        name
        for name, module in list(sys.modules.items())
        if name not in _KNOWN and getattr(module, "__file__", None) and not name.startswith("__main__")
    ]
    data = json.dumps(names[:_REPORT_MAX]).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _preload(names: list[str]) -> tuple[int, str | None]:
    """Import what earlier forks imported; stop at the first import that leaves a thread running."""
    count = 0
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            count += 1
        except BaseException:  # it imported in the agent's process; here it may not (its environment)
            pass
        if _threads() > 1:
            return count, name
    _KNOWN.update(sys.modules)
    return count, None


# ---------------------------------------------------------------------------------------------- the agent
def _become_agent(request: dict, fds: list[int], close: list[int], run, err_w: int, report_w: int) -> None:
    """In the forked agent process: its group, signals, streams, directory, limits and environment; then
    exec the program or run the agent in place. Never returns."""
    code = 1
    try:
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
    except BaseException as exc:  # the start failed: say why on the error pipe
        why = (
            str(exc) if isinstance(exc, OSError) and exc.errno is not None else f"{type(exc).__name__}: {exc}"
        )
        os.write(err_w, why.encode(errors="replace")[:2000])
        os._exit(127)
    os.close(err_w)
    try:
        run(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # the agent's error goes to its log, its exit code says it failed
        _traceback().print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        try:
            _report_imports(report_w)
        except BaseException:
            pass
    os._exit(code & 0xFF)


# ---------------------------------------------------------------------------------------------- the supervisor
def _children() -> dict[int, list[int]]:
    """Each process's children, from /proc's parent links (the kernel here may not list them per process)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def _descendants(root: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """Every process below ``root``."""
    if children is None:
        children = _children()
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


class _Supervisor:
    def __init__(self, channel: socket.socket, grace: float) -> None:
        self.channel = channel
        self.grace = grace
        self.agent = 0
        self.cpu = 0.0
        self.exit: dict | None = None
        self.deadline: float | None = None  # SIGKILL then (after a SIGTERM)
        self.killed_at: float | None = None
        self.strays = 0
        self.buffer = b""
        self.channel_open = True
        self.report = -1  # the agent's list of the modules it imported (read until its end)
        self.imported = b""
        self.result_file: str | None = None  # read once the attempt's processes are gone
        self.own_cpu = 0.0  # this process's CPU seconds when the attempt began
        self.waits = False  # once done, it waits for another attempt (it says so)
        self.unsent = False  # the agent's exit is not yet said

    def kill(self, sig: int) -> None:
        """``sig`` to the agent's process group and to every other process below this one."""
        try:
            os.killpg(self.agent, sig)
        except OSError:
            pass
        for pid in _descendants(os.getpid()):
            try:
                if os.getpgid(pid) != self.agent:
                    os.kill(pid, sig)
            except OSError:
                pass

    def stop(self, grace: float) -> None:
        if self.deadline is None:
            self.kill(signal.SIGTERM)
            self.deadline = time.monotonic() + grace

    def reap(self) -> bool:
        """Collect ended children; True once none is left."""
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return True
            if pid == 0:
                return False
            self.cpu += usage.ru_utime + usage.ru_stime
            if pid == self.agent:
                self.exit = (
                    {"signal": os.WTERMSIG(status)}
                    if os.WIFSIGNALED(status)
                    else {"code": os.WEXITSTATUS(status)}
                )
                self.unsent = True  # said at once if processes are left, else with "done" (one write)
            else:
                self.strays += 1

    def read_channel(self) -> None:
        try:
            data = self.channel.recv(4096)
        except OSError:
            data = b""
        if not data:  # the runner is gone: end the attempt
            self.stop(self.grace)
            self.channel_open = False
            return
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            words = line.split()
            if words and words[0] == b"stop":
                self.stop(float(words[1]) if len(words) > 1 else self.grace)

    def run(self, wake: int) -> int:
        left = 0
        while True:
            if self.reap():
                break
            if self.unsent:
                self.unsent = False
                _send(self.channel, {"exited": self.exit})
            if self.exit is not None and self.deadline is None:
                self.stop(self.grace)  # the agent ended: what it left behind goes too
            now = time.monotonic()
            if self.deadline is not None and now >= self.deadline:
                self.kill(signal.SIGKILL)
                if self.killed_at is None:
                    self.killed_at = now
                elif now - self.killed_at > _KILL_WAIT_SECONDS:
                    left = len(_descendants(os.getpid()))
                    break
                self.deadline = now + 1.0  # again once a second while unkillable ones remain
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            watched: list = [wake, self.channel] if self.channel_open else [wake]
            if self.report >= 0:
                watched.append(self.report)
            ready, _, _ = select.select(watched, [], [], timeout)
            if wake in ready:
                _drain(wake)
            if self.channel in ready:
                self.read_channel()
            if self.report in ready:
                self.read_report()
        while self.report >= 0:  # the agent is gone: what it wrote is all there is
            self.read_report()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu += usage.ru_utime + usage.ru_stime - self.own_cpu
        done: dict = {"cpu_s": round(self.cpu, 6), "strays": self.strays, "left": left}
        if self.waits and not left and self.channel_open:
            done["waits"] = True
        if self.result_file:
            done["result"] = _read_result(self.result_file)
        try:
            done["imported"] = json.loads(self.imported) if self.imported else []
        except ValueError:
            pass
        said = [{"exited": self.exit}] if self.unsent else []
        _send(self.channel, *said, {"done": done})
        return left

    def read_report(self) -> None:
        try:
            chunk = os.read(self.report, 1 << 16)
        except OSError:  # BlockingIOError too: a process it could not kill still holds the pipe
            chunk = b""
        if chunk and len(self.imported) < (1 << 20):
            self.imported += chunk
            return
        os.close(self.report)
        self.report = -1


def _read_result(path: str) -> str:
    """The first bytes of the regular file ``path`` (``""`` when there is none; never blocks on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, _RESULT_MAX).decode("utf-8", errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def _spawn_agent(supervisor: _Supervisor, request: dict, fds: list[int]) -> None:
    """Exec the program with ``posix_spawn`` (a vfork: nothing of this process copied; ~1 ms less than a fork
    and an exec from Python): in its own process group, the default signal dispositions, its streams; the
    working directory is this supervisor's (set first). Says ``started`` or ``failed`` on the channel."""
    env, argv = request["env"], request["argv"]
    program = argv[0]
    if os.sep not in program:
        for folder in env.get("PATH", os.defpath).split(os.pathsep):
            candidate = os.path.join(folder or ".", program)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                program = candidate
                break
    actions = [
        (os.POSIX_SPAWN_DUP2, fds[0], 0),
        (os.POSIX_SPAWN_DUP2, fds[1], 1),
        (os.POSIX_SPAWN_DUP2, fds[1], 2),
        *[(os.POSIX_SPAWN_CLOSE, fd) for fd in sorted(set(fds)) if fd > 2],
    ]
    defaults = (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGCHLD,
        signal.SIGPIPE,
        signal.SIGXFSZ,
        signal.SIGUSR1,
        signal.SIGUSR2,
    )
    why = None
    try:
        os.chdir(request["cwd"])
    except OSError as exc:
        why = f"cannot enter its working directory {request['cwd']!r}: {exc.strerror}"
    try:
        if why is None and os.sep not in program:
            why = f"cannot run {program!r}: No such file or directory"
        if why is None:
            pid = os.posix_spawn(
                program, argv, env, file_actions=actions, setpgroup=0, setsigmask=(), setsigdef=defaults
            )
    except OSError as exc:
        why = f"cannot run {argv[0]!r}: {os.strerror(exc.errno or 0)}"
    finally:
        for fd in fds[:2]:
            os.close(fd)
    if why is not None:
        _send(supervisor.channel, {"failed": why})
        return
    supervisor.agent = pid
    _send(supervisor.channel, {"started": pid})


def _await_attempt(channel: socket.socket, pending: bytes = b"") -> tuple[dict, list[int], bytes] | None:
    """A waiting supervisor's next attempt: its request (one JSON line whose first byte carries the attempt's stdin
    and output), the descriptors, and what came after the line; ``None`` once the channel is closed. ``stop``
    lines before it (sent for the attempt that just ended, after it ended) are skipped."""
    buffer = bytearray(pending)
    fds: list[int] = []
    while True:
        while b"\n" not in buffer:
            if not _receive(channel, buffer, fds):
                for fd in fds:
                    os.close(fd)
                return None
        end = buffer.index(b"\n")
        line = bytes(buffer[:end])
        del buffer[: end + 1]
        if line.split(b" ", 1)[0] != b"stop":
            return json.loads(line), fds, bytes(buffer)


def _attempt(
    channel: socket.socket, request: dict, fds: list[int], run, wake: int, wake_w: int, pending: bytes
):
    """Run one attempt to its end (see the module docstring); returns how many of its processes could not be
    killed, and what the channel held after the attempt's own lines."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    supervisor = _Supervisor(channel, float(request.get("grace", 5.0)))
    supervisor.own_cpu = usage.ru_utime + usage.ru_stime
    supervisor.buffer = pending
    supervisor.result_file = request.get("result_file")
    supervisor.waits = run is None  # a bare supervisor waits for its next attempt once this one is done
    _drain(wake)
    if run is None and not request.get("limits"):
        _spawn_agent(supervisor, request, fds)  # the cheap way, when nothing needs a fork to set up
        return supervisor.run(wake), supervisor.buffer
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        _become_agent(request, fds, [wake, wake_w, err_r, report_r, fds[2]], run, err_w, report_w)
    try:
        os.setpgid(pid, pid)  # as the agent does: whichever runs first, its group exists before a kill
    except OSError:
        pass
    os.close(err_w)
    os.close(report_w)
    os.set_blocking(report_r, False)
    supervisor.report = report_r
    for fd in fds[:2]:
        os.close(fd)
    supervisor.agent = pid
    why = b""
    while True:
        chunk = os.read(err_r, 4096)  # empty once the program was exec'd or the agent runs (close-on-exec)
        if not chunk:
            break
        why += chunk
    os.close(err_r)
    if why:
        _send(channel, {"failed": why.decode(errors="replace")})
    else:
        _send(channel, {"started": pid})
    return supervisor.run(wake), supervisor.buffer


def _supervise(request: dict, fds: list[int], inherited: list[int], run) -> None:
    """A forked supervisor (see the module docstring): of one attempt, or, for a bare template (a spawned
    program), of one attempt at a time for as long as the runner keeps it. Never returns."""
    try:
        os.setsid()
        wake, wake_w = _wake_pipe()  # before closing the template's: a SIGCHLD always has a pipe to wake
        for fd in inherited:
            os.close(fd)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            # only the runner (or the channel closing) ends the supervisor
            signal.signal(signum, signal.SIG_IGN)
        _subreaper()
        channel = socket.socket(fileno=fds[-1])
        channel.setblocking(True)
        pending = b""
        waiting = bool(request.get("spare"))  # forked ahead of its attempt: the attempt comes on the channel
        while True:
            if waiting:
                attempt = _await_attempt(channel, pending)
                if attempt is None:
                    os._exit(0)  # the runner no longer needs it
                request, received, pending = attempt
                if len(received) != 2:
                    for fd in received:
                        os.close(fd)
                    _send(
                        channel, {"failed": "a waiting supervisor got an attempt without its two descriptors"}
                    )
                    os._exit(0)
                fds = [*received, fds[-1]]
                stale = _changed(_STAMPS) if run is not None else None
                if stale is not None:  # a spare forked before the agent's file changed: it must not run it
                    for fd in received:
                        os.close(fd)
                    _send(channel, {"failed": f"{stale} changed", "stale": stale})
                    os._exit(0)
            left, pending = _attempt(channel, request, fds, run, wake, wake_w, pending)
            if run is not None or left:
                os._exit(0)
            waiting = True  # all of the attempt's processes are gone: it may be given the next one
    except BaseException:  # a supervisor never returns into the template's loop
        _traceback().print_exc()
        os._exit(70)
    os._exit(0)


# ---------------------------------------------------------------------------------------------- the template
def _receive(ctl: socket.socket, buffer: bytearray, fds: list[int]) -> bool:
    """Read what the control socket has (data and descriptors); False once it is closed."""
    try:
        data, ancillary, _, _ = ctl.recvmsg(1 << 16, socket.CMSG_SPACE(16 * 4))
    except InterruptedError:
        return True
    except ConnectionError:  # reset by the runner (it closed with data unread): closed all the same
        return False
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds.extend(int.from_bytes(payload[i : i + 4], sys.byteorder) for i in range(0, usable, 4))
    if not data:
        return False
    buffer.extend(data)
    return True


def _reap_template(supervisors: set[int], reparented: bool) -> None:
    """Collect ended supervisors; kill whatever a dead supervisor left behind (reparented here)."""
    abnormal = reparented
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            break
        if pid in supervisors:
            supervisors.discard(pid)
            abnormal = abnormal or status != 0
        else:
            abnormal = True
    if not abnormal:
        return
    children = _children()
    for stray in children.get(os.getpid(), ()):
        if stray in supervisors:
            continue  # a live attempt's supervisor: its processes are its own
        for pid in [stray, *_descendants(stray, children)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


#: How long a template whose runner is gone waits for its supervisors to exit (the waiting ones exit as their
#: channels close, just before): their CPU time then reaches the runner's children's time.
_LINGER_SECONDS = 0.5


def _linger(wake: int, supervisors: set[int]) -> None:
    deadline = time.monotonic() + _LINGER_SECONDS
    while True:
        _reap_template(supervisors, reparented=False)
        left = deadline - time.monotonic()
        if not supervisors or left <= 0:
            return
        select.select([wake], [], [], left)
        _drain(wake)


def main(argv: list[str]) -> None:
    ctl = socket.socket(fileno=int(argv[0]))
    ctl.setblocking(True)
    kind, spec = argv[1], argv[2:]
    subreaper = _subreaper()
    try:
        run, files = _prepare(kind, spec)
    except BaseException as exc:  # the agent cannot be loaded: say why, then stop
        _send(ctl, {"error": f"{type(exc).__name__}: {exc}", "traceback": _traceback().format_exc()[-4000:]})
        os._exit(1)
    stamps = _STAMPS
    stamps.update(_own_files(files))
    _KNOWN.update(sys.modules)
    gc.freeze()  # what is imported now stays out of the collector's reach: forks do not copy it by collecting
    wake, wake_w = _wake_pipe()
    _send(
        ctl,
        {"ready": {"pid": os.getpid(), "threads": _threads(), "subreaper": subreaper, "files": len(stamps)}},
    )
    supervisors: set[int] = set()
    buffer = bytearray()
    fds: list[int] = []
    while True:
        readable: list = [ctl, wake]
        ready, _, _ = select.select(readable, [], [])
        if wake in ready:
            _drain(wake)
            _reap_template(supervisors, reparented=False)
        if ctl not in ready:
            continue
        if not _receive(ctl, buffer, fds):  # the runner closed the control socket
            _linger(wake, supervisors)
            os._exit(0)
        while b"\n" in buffer:
            end = buffer.index(b"\n")
            request = json.loads(bytes(buffer[:end]))
            del buffer[: end + 1]
            if "preload" in request:
                count, culprit = _preload([str(n) for n in request["preload"]])
                if culprit is not None:
                    _send(ctl, {"threads": _threads(), "module": culprit})
                    os._exit(0)  # a thread runs here now: this template must not fork again
                for path, stamp in _own_files(files).items():  # the files it brought in; not a new look at
                    stamps.setdefault(path, stamp)  # those it had: a change made meanwhile stays a change
                gc.freeze()
                _send(ctl, {"preloaded": count})
                continue
            need = 1 if request.get("spare") else 3  # a spare: its channel alone
            mine, fds[:] = fds[:need], fds[need:]
            stale = _changed(stamps)
            threads = _threads()
            if stale is not None or threads > 1 or len(mine) != need:
                for fd in mine:
                    os.close(fd)
                if stale is not None:
                    _send(ctl, {"stale": stale})
                    os._exit(0)
                _send(
                    ctl,
                    {"threads": threads}
                    if threads > 1
                    else {"error": "a fork request came without its descriptors"},
                )
                continue
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            pid = os.fork()
            if pid == 0:
                # the descriptors of requests not yet read (pipelined) are theirs: neither this supervisor nor
                # its agent may hold them (an attempt's output stays open while anyone does)
                _supervise(request, mine, [ctl.fileno(), wake, wake_w, *fds], run)
            for fd in mine:
                os.close(fd)
            supervisors.add(pid)
            _send(ctl, {"forked": pid})


if __name__ == "__main__":
    main(sys.argv[1:])
