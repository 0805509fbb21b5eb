"""fastcomm-run: torchrun-compatible elastic launcher that recovers from failures.

Usage (``fastcomm-run`` is the console script; ``python -m fastcomm.launch`` is the same)::

    fastcomm-run --nproc-per-node 4 train.py --lr 0.1              # one node (standalone)
    fastcomm-run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
                 --rdzv-endpoint node0:29400 --rdzv-id job1 --max-restarts 3 train.py
    fastcomm-run --nnodes 2 --node-rank 1 --master-addr node0 --master-port 29500 train.py
    fastcomm-run --nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint node0:29400 train.py

It takes torchrun's flags (both ``--nproc-per-node`` and ``--nproc_per_node`` spellings, and the
``PET_*`` environment forms) and gives each worker torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE,
ROLE_NAME, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
TORCHELASTIC_RUN_ID, TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_ERROR_FILE,
TORCH_NCCL_ASYNC_ERROR_HANDLING, TORCHELASTIC_SIGNALS_TO_HANDLE, and OMP_NUM_THREADS=1 when
more than one worker per node and it is unset -- torchrun's rule), so a script written for
torchrun (``init_process_group(init_method="env://")`` or ``fastcomm.init()``) runs unchanged.

How it works (one agent per node; see ``agent.py`` and ``rendezvous.py``):

* Rendezvous goes through fastcomm's ``Store`` (torch's ``TCPStore``): the agent on the
  endpoint host serves it (static backend: node rank 0; ``--rdzv-conf is_host=0|1`` overrides),
  the others connect, retrying within ``join_timeout``. Agents agree on the node set and the
  GROUP_RANKs of each *round* in that round's own key namespace.
* Each round's workers meet in a **fresh** ``TCPStore`` on a new free port served by the agent
  of GROUP_RANK 0 (all workers are clients). This is what makes restarts work: torchrun 2.13
  reuses one store for every round, so restarted Gloo workers read the failed round's keys
  (peer addresses, barrier counters) and fail with ``connectFullMesh ... Connection refused``
  or hang. Consequence: MASTER_PORT changes every round and, with the static backend, is not
  ``--master-port`` (that port serves the rendezvous store only).
* A worker exiting non-zero (or recording an uncaught exception) ends the round as a failure on
  every node; all agents stop their workers and restart in a new round until ``--max-restarts``
  is spent, then print the root cause (rank, host, exit code or signal, the worker's own
  traceback) and exit 1. An agent that stops heartbeating (``keep_alive_interval`` x
  ``keep_alive_max_attempt`` s) is declared lost, which is a failure too; the job goes on
  without it if at least MIN nodes remain.
* Elastic ``--nnodes MIN:MAX``: a round starts once MIN nodes joined and ``last_call_timeout``
  passed (or MAX joined). A node that joins a running job waits; the running agents restart
  their workers to admit it (not counted as a restart: TORCHELASTIC_RESTART_COUNT unchanged).
* Python workers run through ``_bootstrap.py``: it records uncaught exceptions to
  TORCHELASTIC_ERROR_FILE in torch's ``@record`` format without the script opting in, and
  kills the worker's process group if the agent dies (even by SIGKILL). ``--no-python``
  programs are exec'ed with ``PR_SET_PDEATHSIG`` (Linux): they die with the agent, but their
  errors are not recorded and their own children are not covered.
* SIGINT/SIGTERM/SIGHUP/SIGQUIT (``--signals-to-handle``) are forwarded to every worker's
  process group; after ``--shutdown-timeout`` s the rest is SIGKILLed; the launcher exits with
  128+signal. Every exit path kills what is left in the workers' process groups.
* Output: each line prefixed ``[rank N]: `` (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``
  overrides). ``--redirects``/``--tee`` write ``<log-dir>/<run_id>_<random>/attempt_<round>/
  <local_rank>/{stdout,stderr}.log`` (round, not restart count: admitting a node starts a new
  round too). Without ``--log-dir`` a temporary directory is used (kept when it holds logs or
  the error files a failure report names).

Exit status: 0 success; 1 job failed (or rendezvous/store error); 2 usage error (nothing was
started); 128+N stopped by signal N.

Accepted but ignored torchrun flags: ``--start-method``, ``--logs-specs``,
``--event-log-handler``, ``--numa-binding``, ``--duplicate-std{out,err}-filters`` (a warning is
printed); ``--run-path`` runs the script in a fresh interpreter as usual.
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
