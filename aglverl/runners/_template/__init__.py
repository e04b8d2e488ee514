"""The template process and the per-attempt supervisor, run by the agent's own Python: stdlib only.

aglverl's runner does not run this package in its own process: it starts ``python -c <bootstrap> <fd> <kind>
<spec>...`` (:mod:`aglverl.runners.template`), whose few lines load this package from its folder under a
private name (``_aglverl_template``: nothing of aglverl is imported, and the agent's own modules cannot shadow
it), so it runs in whatever Python the agent uses (3.8 or later, with or without aglverl installed). Its parts:
:mod:`.main` (the template's loop), :mod:`.preparing` (what a template imports, the agent's own files) with
:mod:`.sources` (what a Python agent's file imports at its top level), :mod:`.preload` (what it learns to import
before its forks: the installation's modules only), :mod:`.supervisor` (an attempt's supervisor), :mod:`.agent` (the forked
agent's process, before the agent runs), :mod:`.wire` (lines and descriptors on sockets, the ``SIGCHLD``
wake-up pipe) and :mod:`.processes` (the process tree as ``/proc`` shows it). One process of it is a
**template**:

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
  spawner starts an attempt with one message instead of a fork. A request ``{"preload": [names]}`` imports
  the modules earlier forks imported, those of the Python installation only (:mod:`.preparing`), and answers
  ``{"preloaded": n, "skipped": [names]}``;
- it is a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): a process orphaned by a supervisor that died
  (killed by its agent, or by the runner) is reparented to the template, which kills it;
- it exits when the runner closes its control socket.

A **supervisor** (of one attempt at a time) starts a session of its own, becomes a child subreaper, and forks the
agent's process: in a process group of its own, with the attempt's environment, working directory, standard
streams and resource limits, running the agent in place (``class`` and the Python kinds: no new interpreter,
nothing imported again, its random generators reseeded: :mod:`.agent`) or exec'ing the program (``bare``).
Every process the agent starts stays in the supervisor's tree, even one that left the agent's process group or
session (``setsid``, a double fork): when its parent dies it is reparented to the supervisor. The supervisor
reports on the attempt's channel (newline-delimited JSON): ``{"started": pid}`` or ``{"failed": why}``, then
``{"exited": {"code"|"signal": n}}`` when the agent's process ends, then ``{"done": {"cpu_s": x, "strays": n,
"result": text}}`` once no process of the attempt is left (``result``: the first bytes of the request's
``result_file``, the reward file, read then: ``""`` when it is not a regular file; the runner needs no thread to
read it). Whatever way the agent's process ends, what it left behind gets ``SIGTERM`` and, after the grace
period, ``SIGKILL``. ``stop <grace>`` on the channel (or the channel closing: the runner is gone) does the same
to the agent's process and everything it started. Waiting is ``select`` on the channel and on the ``SIGCHLD``
wake-up pipe, with the grace period's deadline as the only timeout. Once done, a bare template's supervisor (a
spawned program's) says ``"waits": true`` in its ``done`` and waits on the same channel for its next attempt,
as a spare does (the runner keeps it, or closes the channel: it exits); a Python template's supervisor exits,
and so does one that could not kill all of its attempt's processes. A spare of a Python template checks the
agent's files before it forks the agent (``{"failed": ..., "stale": path}`` when one changed since it was
forked). A supervisor that stops answering (stopped, traced, its channel held by its agent) is the runner's to
end (:class:`aglverl.runners.template.SupervisedProcess`).
"""
