"""fastcomm-run, a torchrun-compatible launcher that restarts failed jobs (usage: README).

Modules, from the command line down:

* ``cli``: torchrun's flags (both spellings, ``PET_*`` defaults) -> ``LaunchConfig``; usage
  errors exit 2 before anything starts.
* ``agent``: one ``Agent`` per node: rendezvous, start the workers, monitor, restart, report.
* ``rendezvous``: the agents agree round by round on the node set over the rendezvous store;
  its module docstring lists the store keys.
* ``workers``: the worker processes of one round (start, poll, signal, stop, output prefixes).
* ``errors``: ``Failure`` records, the workers' error files, the root-cause report.
* ``config``: ``LaunchConfig`` and its parsers.
* ``net``: the address the stores listen on (loopback for a single node, never every
  interface).
* ``_bootstrap``: run by path in every worker (standard library only): records uncaught
  exceptions to ``TORCHELASTIC_ERROR_FILE`` and kills the worker's process group if the agent
  dies.

Invariants:

* The launcher imports only ``fastcomm.comm.store`` (and ``.errors``) of fastcomm, never a
  backend; the workers import nothing of fastcomm before the user's script does.
* Workers get exactly torchrun's environment, so torchrun scripts run unchanged.
* Every round has its own key namespace and its own worker store: nothing of a failed round is
  read by the next one.
* A round ends once (the first end proposed wins), on every node alike.
* Nothing read back from a store is executed: values are JSON, signed with the job's secret
  when it has one, and type-checked (see ``rendezvous``).
* Every exit path stops what is left in the workers' process groups (SIGTERM, then SIGKILL
  after ``--shutdown-timeout``, default 30 s as torchrun), removes the shared-memory segment
  files its reaped workers left (see ``workers``) and the temporary folder. Exit status: 0 success,
  1 job failed (or rendezvous/store error), 2 usage error (a bad flag or environment variable,
  a port in use), 128+N stopped by signal N.
"""

__all__ = ["main", "launch", "LaunchConfig"]


def __getattr__(name: str):
    if name == "main":
        from .cli import main

        return main
    if name == "launch":
        from .agent import launch

        return launch
    if name == "LaunchConfig":
        from .config import LaunchConfig

        return LaunchConfig
    raise AttributeError(f"module 'fastcomm.launch' has no attribute {name!r}")
