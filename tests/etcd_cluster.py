"""Real etcd clusters for tests: N members on free ports of 127.0.0.1, in a directory of their own.

``EtcdCluster(3, tmp).start()`` runs three ``etcd`` processes (the Debian package
``etcd-server``), waits until each says it is healthy (bounded), and ``stop()`` kills them and
removes their directory; :func:`etcd_cluster_fixture` makes a module-scoped fixture of it
that skips where ``etcd`` is not installed, naming the command that installs it. Elections are
fast (50 ms heartbeats, 500 ms election timeout), so a lost member is replaced in about a
second.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

from tests.harness import free_port

INSTALL = "apt-get install -y etcd-server etcd-client"
"""What installs ``etcd`` (as root, on Debian/Ubuntu); the skip reason names it."""
START_TIMEOUT_S = 30.0
_ATTEMPTS = 3  # a port taken by someone else between free_port() and etcd's bind: new ports


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/health")
        return str(json.loads(conn.getresponse().read() or b"{}").get("health")) == "true"
    except (OSError, ValueError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class EtcdCluster:
    """``size`` etcd members on 127.0.0.1.

    Args:
        size: number of members (1 or 3, say).
        root: a directory for the members' data and logs (removed by :meth:`stop`); default
            a new temporary one.
    """

    def __init__(self, size: int, root: str | None = None) -> None:
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least one member, got {size}")
        self.size = size
        self.root = root or tempfile.mkdtemp(prefix="fastcomm-etcd-")
        self.client_ports: list[int] = []
        self.procs: list[subprocess.Popen] = []

    @property
    def endpoints(self) -> str:
        """``127.0.0.1:p1,127.0.0.1:p2,...``, in member order."""
        return ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    def endpoint(self, member: int) -> str:
        return f"127.0.0.1:{self.client_ports[member]}"

    def start(self) -> EtcdCluster:
        """Starts every member and waits until each is healthy.

        Raises:
            RuntimeError: a member exited, or was not healthy within 30 s (its log's tail
                is in the message).
        """
        for attempt in range(_ATTEMPTS):
            try:
                self._start_once(f"a{attempt}")
                return self
            except RuntimeError:
                self._kill_all()
                if attempt == _ATTEMPTS - 1:
                    self.stop()
                    raise
        return self

    def _start_once(self, tag: str) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError(f"no etcd binary ({INSTALL})")
        self.client_ports = [free_port() for _ in range(self.size)]
        peer_ports = [free_port() for _ in range(self.size)]
        names = [f"m{i}" for i in range(self.size)]
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(names, peer_ports,
                                                                       strict=True))
        token = f"fastcomm-test-{os.getpid()}-{tag}-{self.client_ports[0]}"
        self.procs = []
        for name, client, peer in zip(names, self.client_ports, peer_ports, strict=True):
            log = open(os.path.join(self.root, f"{name}-{tag}.log"), "wb")  # noqa: SIM115
            with log:
                self.procs.append(subprocess.Popen(
                    [binary, "--name", name,
                     "--data-dir", os.path.join(self.root, f"{name}-{tag}"),
                     "--listen-client-urls", f"http://127.0.0.1:{client}",
                     "--advertise-client-urls", f"http://127.0.0.1:{client}",
                     "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                     "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                     "--initial-cluster", initial, "--initial-cluster-state", "new",
                     "--initial-cluster-token", token,
                     "--heartbeat-interval", "50", "--election-timeout", "500",
                     "--logger", "zap", "--log-level", "error"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                ))
        start = time.monotonic()
        waiting = set(range(self.size))
        while waiting:
            for member in sorted(waiting):
                if self.procs[member].poll() is not None:
                    raise RuntimeError(f"etcd member {member} exited with "
                                       f"{self.procs[member].returncode}: {self._log(tag)}")
                if _healthy(self.client_ports[member]):
                    waiting.discard(member)
            if waiting and time.monotonic() - start > START_TIMEOUT_S:
                raise RuntimeError(f"etcd members {sorted(waiting)} not healthy after "
                                   f"{START_TIMEOUT_S:.0f} s: {self._log(tag)}")
            time.sleep(0.05)

    def _log(self, tag: str) -> str:
        tails = []
        for i in range(self.size):
            try:
                with open(os.path.join(self.root, f"m{i}-{tag}.log"), "rb") as f:
                    tails.append(f"m{i}: " + f.read()[-400:].decode(errors="replace"))
            except OSError:
                pass
        return " | ".join(tails)

    def kill(self, member: int) -> None:
        """Kills one member at once (SIGKILL), as a node that dies."""
        proc = self.procs[member]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def _kill_all(self) -> None:
        for member in range(len(self.procs)):
            self.kill(member)

    def stop(self) -> None:
        """Kills every member and removes the directory (idempotent)."""
        self._kill_all()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def etcd_cluster_fixture(size: int, scope: str = "module"):
    """A pytest fixture yielding a started :class:`EtcdCluster` of ``size`` members, stopped
    after (also when a test fails); skips where ``etcd`` is not installed."""
    import pytest

    @pytest.fixture(scope=scope)
    def fixture(tmp_path_factory):
        if etcd_binary() is None:
            pytest.skip(f"needs the etcd server binary: {INSTALL}")
        cluster = EtcdCluster(size, str(tmp_path_factory.mktemp(f"etcd{size}")))
        with cluster:
            yield cluster

    return fixture
