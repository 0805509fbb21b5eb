"""Command line: torchrun's flag spellings, PET_* defaults, usage errors before anything starts."""

from __future__ import annotations

import pytest

from fastcomm.launch import agent as agent_mod
from fastcomm.launch.cli import get_parser, main, parse_config
from fastcomm.launch.config import LaunchConfig, parse_endpoint, parse_nnodes, parse_std

from ._util import run, script

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if the agent would start."""
    calls = []

    def fake_launch(config):
        calls.append(config)
        raise AssertionError("the agent must not start on a usage error")

    monkeypatch.setattr(agent_mod, "launch", fake_launch)
    return calls


@pytest.fixture
def marker_script(tmp_path):
    marker = tmp_path / "started"
    path = script(tmp_path, "train.py", f"open({str(marker)!r}, 'w').close()\n")
    return path, marker


def config_of(argv, monkeypatch=None) -> LaunchConfig:
    return parse_config(get_parser().parse_args(argv))


BAD = [
    pytest.param(["--bogus-flag"], "unrecognized arguments", id="unknown-flag"),
    pytest.param(["--nnodes", "3:2"], "MIN must be <= MAX", id="nnodes-3:2"),
    pytest.param(["--nnodes", "0"], "must be >= 1", id="nnodes-0"),
    pytest.param(["--nnodes", "a:b"], "N or MIN:MAX", id="nnodes-garbage"),
    pytest.param(["--nproc-per-node", "0"], "--nproc-per-node must be >= 1", id="nproc-0"),
    pytest.param(["--nproc-per-node", "many"], "--nproc-per-node must be", id="nproc-word"),
    pytest.param(["--max-restarts", "-1"], "--max-restarts must be >= 0", id="restarts-neg"),
    pytest.param(
        ["--monitor-interval", "0"], "--monitor-interval must be a finite number", id="monitor-0"
    ),
    pytest.param(["--rdzv-backend", "zookeeper"], "static, c10d or etcd", id="backend"),
    pytest.param(["--rdzv-backend", "etcd"], "needs --rdzv-endpoint", id="etcd-no-endpoint"),
    pytest.param(["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h1:2379,,h2"], "is not host",
                 id="etcd-empty-item"),
    pytest.param(["--rdzv-backend", "etcd", "--rdzv-endpoint", "https://h1:2379"],
                 "TLS is not supported", id="etcd-tls"),
    pytest.param(["--rdzv-backend", "etcd", "--rdzv-endpoint", "h1:2379", "--standalone"],
                 "contradicts --rdzv-backend etcd", id="etcd-standalone"),
    pytest.param(["--rdzv-backend", "etcd", "--rdzv-endpoint", "h1", "--rdzv-conf",
                  "is_host=1"], "no agent serves the rendezvous", id="etcd-is-host"),
    pytest.param(["--rdzv-backend", "etcd", "--rdzv-endpoint", "h1", "--rdzv-conf",
                  "store_type=tcp"], "leave store_type out", id="etcd-store-type"),
    pytest.param(
        ["--rdzv-backend", "c10d", "--nnodes", "2"], "needs --rdzv-endpoint", id="c10d-no-endpoint"
    ),
    pytest.param(
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:p", "--nnodes", "2"],
        "host:port",
        id="endpoint-garbage",
    ),
    pytest.param(
        ["--nnodes", "1:2", "--master-port", "29511"], "fixed --nnodes", id="static-elastic"
    ),
    pytest.param(
        ["--nnodes", "2", "--node-rank", "2", "--master-port", "29511"],
        "--node-rank must be in",
        id="node-rank-range",
    ),
    pytest.param(["--standalone", "--nnodes", "2"], "single node", id="standalone-nnodes"),
    pytest.param(["--rdzv-conf", "join_timeout"], "<key1>=<value1>", id="rdzv-conf"),
    pytest.param(["--rdzv-conf", "join_timeout=soon"], "must be a number", id="rdzv-conf-val"),
    pytest.param(["--redirects", "4"], "neither 0-3", id="redirects"),
    pytest.param(["--tee", "0:5"], "neither 0-3", id="tee"),
    pytest.param(["--local-ranks-filter", "x"], "comma-separated", id="ranks-filter"),
    pytest.param(["--signals-to-handle", "SIGNOPE"], "unknown signal", id="signals"),
    pytest.param(["--start-method", "thread"], "invalid choice", id="start-method"),
    pytest.param(["--nproc-per-node", "100000000"], "must be <= 4096", id="nproc-huge"),
    # infinite, NaN, negative or absurd intervals and timeouts (they would only fail mid-job)
    pytest.param(["--monitor-interval", "inf"], "finite number", id="monitor-inf"),
    pytest.param(["--monitor-interval", "nan"], "finite number", id="monitor-nan"),
    pytest.param(["--monitor-interval", "-1"], "finite number", id="monitor-neg"),
    pytest.param(["--shutdown-timeout", "inf"], "--shutdown-timeout must be", id="shutdown-inf"),
    pytest.param(["--shutdown-timeout", "0"], "--shutdown-timeout must be", id="shutdown-0"),
    pytest.param(["--shutdown-timeout", "soon"], "invalid float", id="shutdown-word"),
    pytest.param(["--rdzv-conf", "join_timeout=inf"], "join_timeout must be", id="join-inf"),
    pytest.param(["--rdzv-conf", "read_timeout=nan"], "read_timeout must be", id="read-nan"),
    pytest.param(["--rdzv-conf", "last_call_timeout=1e300"], "finite number", id="huge"),
    pytest.param(["--rdzv-conf", "keep_alive_max_attempt=x"], "must be an int", id="attempts"),
    pytest.param(["--rdzv-conf", "is_host=maybe"], "must be a boolean", id="is-host"),
    pytest.param(["--max-restarts", "many"], "invalid int", id="restarts-word"),
    pytest.param(["--node-rank", "x"], "invalid int", id="node-rank-word"),
    pytest.param(["--master-port", "70000"], "--master-port must be in", id="master-port"),
    pytest.param(["--master-port", "29511", "--master-addr", ""], "--master-addr", id="addr"),
    pytest.param(
        ["--rdzv-id", "", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"],
        "--rdzv-id must be non-empty",
        id="rdzv-id",
    ),
    pytest.param(["--role", ""], "--role must be non-empty", id="role"),
    pytest.param(["--log-dir", "/proc/no/such"], "cannot be created", id="log-dir"),
    pytest.param(["--log-dir", ""], "--log-dir must be non-empty", id="log-dir-empty"),
    pytest.param(["--local-addr", "0.0.0.0"], "not '0.0.0.0' (every interface)", id="wildcard"),
    pytest.param(["--local-addr", "192.0.2.1"], "not an address of this machine", id="addr"),
    pytest.param(["--job-secret-file", "/no/such/secret"], "cannot read", id="secret-file"),
]


@pytest.mark.parametrize(("flags", "message"), BAD)
def test_bad_flags_are_usage_errors(flags, message, marker_script, no_launch, capsys):
    path, marker = marker_script
    assert main([*flags, str(path)]) == 2
    err = capsys.readouterr().err
    assert "usage: fastcomm-run" in err and message in err
    assert "Traceback" not in err and len([x for x in err.splitlines() if "error:" in x]) == 1
    assert not no_launch and not marker.exists()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "x"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT must be"),
        ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "inf"}, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT must be"),
        ({"FASTCOMM_JOB_SECRET": "not hex"}, "FASTCOMM_JOB_SECRET must be hex"),
        ({"FASTCOMM_JOB_SECRET": "abcd"}, "at least 16 bytes"),
        ({"FASTCOMM_JOB_SECRET_FILE": "/no/such"}, "FASTCOMM_JOB_SECRET_FILE: cannot read"),
        ({"PET_MONITOR_INTERVAL": "inf"}, "--monitor-interval must be"),
    ],
    ids=["shutdown-env", "shutdown-env-inf", "secret-hex", "secret-short", "secret-file", "pet"],
)
def test_bad_environment_is_a_usage_error(env, message, marker_script, no_launch, capsys,
                                          monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    path, marker = marker_script
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not no_launch and not marker.exists()


def test_missing_script_is_a_usage_error(no_launch, capsys, tmp_path):
    assert main(["--nproc-per-node", "2"]) == 2
    assert "the following arguments are required: training_script" in capsys.readouterr().err
    assert main([str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["--no-python", "-m", "pkg"]) == 2
    assert "--no-python" in capsys.readouterr().err
    assert not no_launch


def test_help_exits_zero(no_launch, capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--nnodes",
        "--nproc-per-node",
        "--rdzv-endpoint",
        "--max-restarts",
        "--standalone",
        "--redirects",
        "--tee",
        "--log-dir",
        "--no-python",
    ):
        assert flag in out


def test_usage_error_from_the_command_line(tmp_path):
    """`python -m fastcomm.launch` exits 2 with a usage message and starts nothing."""
    marker = tmp_path / "started"
    path = script(tmp_path, "train.py", f"open({str(marker)!r}, 'w').close()\n")
    result = run(["--nnodes", "3:2", path], tmp_path, timeout=50)
    assert result.returncode == 2, result.stderr
    assert "usage: fastcomm-run" in result.stderr and "MIN must be <= MAX" in result.stderr
    assert not marker.exists()


def test_both_spellings_and_defaults(marker_script):
    path, _ = marker_script
    a = config_of(
        [
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "2",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            "127.0.0.1:29400",
            "--nnodes",
            "1:4",
            "--rdzv-conf",
            "last_call_timeout=2,join_timeout=9",
            str(path),
            "--lr",
            "1",
        ]
    )
    b = config_of(
        [
            "--nproc_per_node",
            "3",
            "--max_restarts",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:29400",
            "--nnodes",
            "1:4",
            "--rdzv_conf",
            "last_call_timeout=2,join_timeout=9",
            str(path),
            "--lr",
            "1",
        ]
    )
    assert a == b
    assert (a.nproc_per_node, a.max_restarts, a.min_nodes, a.max_nodes) == (3, 2, 1, 4)
    assert (a.rdzv_host, a.rdzv_port, a.last_call_timeout, a.join_timeout) == (
        "127.0.0.1",
        29400,
        2.0,
        9.0,
    )
    assert a.args == ["--lr", "1"] and a.entrypoint == str(path)
    # A single node without an endpoint is standalone, as torchrun: a free port, a uuid run id.
    c = config_of([str(path)])
    assert c.standalone and c.rdzv_backend == "c10d" and len(c.run_id) == 36
    # static with a master port: the endpoint is master_addr:master_port, run id "none".
    d = config_of(["--master-port", "29555", str(path)])
    assert (d.rdzv_backend, d.rdzv_host, d.rdzv_port, d.run_id) == (
        "static",
        "127.0.0.1",
        29555,
        "none",
    )


def test_pet_environment_defaults(monkeypatch, marker_script):
    path, _ = marker_script
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("PET_NODE_RANK", "1")
    monkeypatch.setenv("PET_MASTER_PORT", "29512")
    monkeypatch.setenv("PET_MAX_RESTARTS", "5")
    monkeypatch.setenv("PET_ROLE", "trainer")
    monkeypatch.setenv("PET_STANDALONE", "0")
    cfg = config_of([str(path)])
    assert (cfg.nproc_per_node, cfg.max_nodes, cfg.node_rank, cfg.rdzv_port) == (4, 2, 1, 29512)
    assert (cfg.max_restarts, cfg.role) == (5, "trainer")
    # The command line wins over PET_*.
    assert config_of(["--nproc-per-node", "2", str(path)]).nproc_per_node == 2
    monkeypatch.setenv("PET_NNODES", "1")
    monkeypatch.delenv("PET_MASTER_PORT")
    monkeypatch.setenv("PET_NODE_RANK", "0")
    monkeypatch.setenv("PET_STANDALONE", "1")
    assert config_of([str(path)]).standalone


def test_etcd_backend_flags(marker_script):
    """torchrun's etcd spellings: etcd and etcd-v2 alike, endpoints with etcd's port 2379 where
    none is given, duplicates dropped; the run id and MIN:MAX as with c10d."""
    path, _ = marker_script
    flags = ["--nnodes", "2:3", "--rdzv-endpoint", "10.0.0.1:2379,10.0.0.2,[::1]:3379,10.0.0.1",
             "--rdzv-id", "job7", str(path)]
    a = config_of(["--rdzv-backend", "etcd", *flags])
    b = config_of(["--rdzv_backend", "etcd-v2", *flags])
    assert a == b and a.rdzv_backend == "etcd" and a.run_id == "job7"
    assert a.rdzv_endpoints == ("10.0.0.1:2379", "10.0.0.2:2379", "[::1]:3379")
    assert (a.rdzv_host, a.rdzv_port, a.min_nodes, a.max_nodes) == ("10.0.0.1", 2379, 2, 3)
    assert not a.standalone
    with pytest.raises(ValueError, match="needs --rdzv-endpoint"):
        LaunchConfig(entrypoint="x.py", rdzv_backend="etcd")


def test_module_and_no_python(tmp_path):
    cfg = config_of(["-m", "pkg.train", "--epochs", "3"])
    assert cfg.module and cfg.entrypoint == "pkg.train" and cfg.args == ["--epochs", "3"]
    cfg = config_of(["--no-python", "echo", "hi"])
    assert cfg.no_python and cfg.entrypoint == "echo" and cfg.args == ["hi"]


def test_parsers():
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:4") == (1, 4)
    assert parse_endpoint("node0:29400") == ("node0", 29400)
    assert parse_endpoint("[::1]:5") == ("::1", 5)
    assert parse_endpoint("node0", default_port=29400) == ("node0", 29400)
    assert parse_std("3") == 3 and parse_std("0:3,1:1") == {0: 3, 1: 1}
    for bad in ("node0:99999", "a:b:c"):
        with pytest.raises(ValueError):
            parse_endpoint(bad)
    with pytest.raises(ValueError, match="MIN <= MAX"):
        LaunchConfig(entrypoint="x.py", min_nodes=3, max_nodes=2)
