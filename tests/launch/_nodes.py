"""Real nodes on one machine: each in its own network, UTS, mount and PID namespace.

``Nodes(shared, count)`` makes ``count`` nodes (2 or 3) joined by a bridge in a namespace of its
own (a switch), one veth pair per node, with no route out: node ``i`` is ``10.213.34.<i+1>`` on
a /24 that exists only inside these namespaces. Each node has its own hostname (``node<i>``),
its own tmpfs on ``/dev/shm`` and ``/tmp``, and a Debian-style ``/etc/hosts`` (its own name on
127.0.1.1, the others' on the bridge); ``FASTCOMM_HOST_ID`` is unset, so fastcomm tells the
hosts apart as it would machines. The checkout and this interpreter's prefixes are bound back
over the node's own ``/tmp`` and ``/dev/shm`` where they lie there (CI's clone, a venv in a
temporary folder), and the node runs ``sys.executable``: the nodes import what pytest does.
:meth:`Nodes.start_etcd` runs an etcd member on a node (its network namespace, its data under
the shared folder). Root, ``ip netns`` (iproute2), ``unshare`` and ``mount`` (util-linux) are
needed: :func:`why_not` says what is missing.

Everything made here (namespaces, the bridge, the veth pairs, mounts, processes) goes with
:meth:`Nodes.remove`, also on failure: each node runs under ``unshare --kill-child`` as PID 1
of its own PID namespace, so killing the outer process kills every process of the node, its
mounts go with its mount namespace, and deleting the network namespaces deletes the bridge and
the veth pairs.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ._util import REPO, clean_env

ADDRS = ("10.213.34.1", "10.213.34.2", "10.213.34.3")
NEEDS = (
    "the node tests need root (network, UTS, mount and PID namespaces), `ip` (iproute2), "
    "`unshare` and `mount` (util-linux), and leave to run `ip netns add`"
)
HIDDEN = ("/tmp", "/dev/shm")  # each node mounts a tmpfs of its own on these
# etcd's own ports, inside the nodes' private network only: nothing else can listen there
ETCD_CLIENT, ETCD_PEER = 2379, 2380


def why_not() -> str | None:
    """Why the nodes cannot be made here (``None``: they can)."""
    if os.name != "posix" or os.geteuid() != 0:
        return f"{NEEDS}: not root"
    missing = [tool for tool in ("ip", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        return f"{NEEDS}: {', '.join(missing)} not found"
    probe = f"fcprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"{NEEDS}: `ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _bound_back() -> list[str]:
    """Paths the node's tmpfs mounts would hide that its processes need: the checkout (also the
    editable install's target) and the interpreter's prefixes, as named and as resolved, under
    ``/tmp`` or ``/dev/shm``; a path inside another one comes with it."""
    named = {str(REPO), sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths = {os.path.abspath(p) for p in named} | {os.path.realpath(p) for p in named}
    hidden = [p for p in paths if any(p == h or p.startswith(h + "/") for h in HIDDEN)]
    return [p for p in sorted(hidden) if not any(p.startswith(q + "/") for q in hidden)]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Nodes:
    """``count`` namespaced nodes; :meth:`start` runs a command as ``node<i>``."""

    def __init__(self, shared: Path, count: int = 2) -> None:
        if not 1 <= count <= len(ADDRS):
            raise ValueError(f"1 to {len(ADDRS)} nodes, got {count}")
        tag = f"{os.getpid() % 100000}"
        self.count = count
        self.netns = [f"fc34n{i}-{tag}" for i in range(count)]
        self.switch = f"fc34sw-{tag}"
        self.veth = [f"fc34{i}n{tag}" for i in range(count)]  # the node's end (in the node)
        self.ports = [f"fc34{i}s{tag}" for i in range(count)]  # the switch's end
        self.shared = shared
        self.procs: list[subprocess.Popen] = []
        self.etcd: dict[int, subprocess.Popen] = {}

    def build(self) -> None:
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        names = "".join(f"{ADDRS[i]} node{i}\n" for i in range(self.count))
        for i, (ns, dev, port) in enumerate(zip(self.netns, self.veth, self.ports, strict=True)):
            ip("netns", "add", ns)
            ip("link", "add", dev, "type", "veth", "peer", "name", port)
            ip("link", "set", dev, "netns", ns)
            ip("link", "set", port, "netns", self.switch)
            ip("-n", self.switch, "link", "set", port, "master", "br0")
            ip("-n", self.switch, "link", "set", port, "up")
            ip("-n", ns, "addr", "add", f"{ADDRS[i]}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            (self.shared / f"hosts{i}").write_text(
                f"127.0.0.1 localhost\n127.0.1.1 node{i}\n{names}")

    def start(
        self, i: int, args: list[str], name: str, program: tuple[str, ...] = ("-m",
                                                                              "fastcomm.launch")
    ) -> subprocess.Popen:
        """``python *program *args`` (by default ``python -m fastcomm.launch *args``) on node
        ``i``; output in ``<name>.out/.err``."""
        env = clean_env()
        env.pop("FASTCOMM_HOST_ID", None)
        env.pop("GLOO_SOCKET_IFNAME", None)
        # what the tmpfs mounts hide (_bound_back) is held on /mnt/.hold<i>-<k> first, then
        # bound back over the node's own /tmp and /dev/shm
        paths = [shlex.quote(p) for p in _bound_back()]
        hold = [f"/mnt/.hold{i}-{k}" for k in range(len(paths))]
        inner = " && ".join([
            f"hostname node{i}",
            f"mount --bind {shlex.quote(str(self.shared))} /mnt",
            *(f"mkdir -p {h} && mount --bind {p} {h}" for p, h in zip(paths, hold, strict=True)),
            *(f"mount -t tmpfs tmpfs {h}" for h in HIDDEN),
            *(f"mkdir -p {p} && mount --bind {h} {p}" for p, h in zip(paths, hold, strict=True)),
            f"mount --bind /mnt/hosts{i} /etc/hosts",
            "cd /mnt",
            f"exec {shlex.quote(sys.executable)} {shlex.join([*program, *args])} "
            f"> /mnt/{name}.out 2> /mnt/{name}.err",
        ])
        cmd = [
            "ip", "netns", "exec", self.netns[i],
            "unshare", "--uts", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
            "sh", "-c", inner,
        ]
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait_joined(self, i: int, port: int, run_id: str, proc: subprocess.Popen, name: str,
                    timeout: float = 60.0) -> None:
        """Waits until a node has joined round 0 of ``run_id`` in the rendezvous store node
        ``i`` serves on ``port`` (its first node record is written), looking from node ``i``'s
        network; raises naming the store, what it waited for and how long, with ``name``'s log."""
        probe = subprocess.run(
            ["ip", "netns", "exec", self.netns[i], sys.executable, "-c", JOINED, ADDRS[i],
             str(port), f"fastcomm.launch/{run_id}/r0", str(timeout)],
            env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout + 30,
        )
        if probe.returncode != 0 or proc.poll() is not None:
            raise AssertionError(f"{probe.stderr[-2000:]}\n{name}:\n{self.err(name)}")

    def result(self, proc: subprocess.Popen, name: str, timeout: float) -> tuple[int, str]:
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            message = f"{name} did not finish in {timeout} s:\n{self.err(name)}"
            raise AssertionError(message) from None
        return code, self.err(name)

    def err(self, name: str) -> str:
        path = self.shared / f"{name}.err"
        return path.read_text() if path.exists() else ""

    def out(self, name: str) -> str:
        path = self.shared / f"{name}.out"
        return path.read_text() if path.exists() else ""

    def link(self, i: int, up: bool) -> None:
        """Node ``i``'s link up or down (down: nothing it sends arrives, no connection closes)."""
        ip("-n", self.netns[i], "link", "set", self.veth[i], "up" if up else "down")

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """Ends a node: its unshare dies, its PID 1 gets SIGKILL, and every process with it."""
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    # ------------------------------------------------------------------ etcd
    @property
    def etcd_endpoints(self) -> str:
        """Every node's member, ``10.213.34.1:2379,...``."""
        return ",".join(f"{ADDRS[i]}:{ETCD_CLIENT}" for i in range(self.count))

    def start_etcd(self, i: int) -> None:
        """Starts node ``i``'s etcd member (again, after :meth:`kill_etcd`: from its data), in
        the node's network namespace; fast elections (50 ms heartbeats, 500 ms timeout)."""
        binary = shutil.which("etcd")
        peers = ",".join(f"m{k}=http://{ADDRS[k]}:{ETCD_PEER}" for k in range(self.count))
        log = open(self.shared / f"etcd{i}.log", "ab")  # noqa: SIM115
        with log:
            self.etcd[i] = subprocess.Popen(
                ["ip", "netns", "exec", self.netns[i], binary, "--name", f"m{i}",
                 "--data-dir", str(self.shared / f"etcd{i}"),
                 "--listen-client-urls", f"http://{ADDRS[i]}:{ETCD_CLIENT}",
                 "--advertise-client-urls", f"http://{ADDRS[i]}:{ETCD_CLIENT}",
                 "--listen-peer-urls", f"http://{ADDRS[i]}:{ETCD_PEER}",
                 "--initial-advertise-peer-urls", f"http://{ADDRS[i]}:{ETCD_PEER}",
                 "--initial-cluster", peers, "--initial-cluster-state", "new",
                 "--initial-cluster-token", f"fastcomm-nodes-{self.switch}",
                 "--heartbeat-interval", "50", "--election-timeout", "500",
                 "--logger", "zap", "--log-level", "error"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill_etcd(self, i: int) -> None:
        """Kills node ``i``'s member at once (SIGKILL)."""
        proc = self.etcd.get(i)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def etcdctl(self, i: int, *args: str, timeout: float = 10) -> str:
        """``etcdctl`` (API v3) on node ``i`` against every member; its output (raises on a
        non-zero exit)."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.netns[i], "etcdctl", "--endpoints",
             self.etcd_endpoints, "--dial-timeout", "1s", "--command-timeout", "3s", *args],
            capture_output=True, text=True, timeout=timeout, env={**os.environ,
                                                                  "ETCDCTL_API": "3"},
        )
        if done.returncode != 0:
            raise AssertionError(f"etcdctl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def etcd_up(self, timeout: float = 30.0) -> None:
        """Starts every member that is not running and waits until the cluster is healthy and
        has a leader."""
        for i in range(self.count):
            if self.etcd.get(i) is None or self.etcd[i].poll() is not None:
                self.start_etcd(i)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.leader() is not None:
                    return
            except (AssertionError, subprocess.TimeoutExpired):
                pass  # not up yet
            if time.monotonic() > deadline:
                logs = {i: (self.shared / f"etcd{i}.log").read_text()[-400:]
                        for i in range(self.count)}
                raise AssertionError(f"etcd not healthy after {timeout:.0f} s: {logs}")
            time.sleep(0.2)

    def leader(self) -> int | None:
        """The node whose member leads (``None``: not every member answers, or no leader)."""
        rows = json.loads(self.etcdctl(0, "endpoint", "status", "-w", "json"))
        if len(rows) < self.count:
            return None
        ids = {row["Status"]["header"]["member_id"]: row["Endpoint"] for row in rows}
        leads = {row["Status"].get("leader", 0) for row in rows}  # JSON omits a 0 (none)
        if len(leads) != 1 or (lead := leads.pop()) not in ids:
            return None
        return self.etcd_endpoints.split(",").index(ids[lead])

    # ------------------------------------------------------------------ teardown
    def end_test(self) -> None:
        """Ends every node a test started that still runs (a test that failed midway), so the
        next test of the module finds the network and the rendezvous port free."""
        for proc in self.procs:
            self.kill(proc)
        self.procs.clear()

    def remove(self) -> None:
        self.end_test()
        for i in list(self.etcd):
            self.kill_etcd(i)
        # deleting a namespace deletes the veth end and the bridge it holds
        for ns in (*self.netns, self.switch):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def check_removed(self) -> None:
        """Asserts that no namespace, bridge or veth of these nodes is left."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(ns in listed for ns in (*self.netns, self.switch)), listed
        links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
        assert not any(dev in links for dev in (*self.veth, *self.ports)), links


# Run in a node's network: waits until round 0's first node record is in the rendezvous store
# at argv[1]:argv[2] (argv[3]: the round's namespace), for at most argv[4] seconds.
JOINED = """
import sys, time
from fastcomm.comm.errors import FastcommError
from fastcomm.comm.store import Store

addr, port, namespace, limit = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
start, store = time.monotonic(), None
while True:
    try:
        store = store or Store(addr, port, timeout=5, _secret=None).prefixed(namespace)
        if store.check(["node/0"]):
            break
    except FastcommError:  # nothing listens yet
        store = None
    waited = time.monotonic() - start
    if waited > limit:
        sys.exit(f"no node joined {namespace} at {addr}:{port} within {waited:.1f} s")
    time.sleep(0.05)
"""
