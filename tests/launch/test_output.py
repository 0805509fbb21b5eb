"""Worker output: ``[rank N]:`` prefixes on the console, ``--redirects``/``--tee`` files under
``--log-dir`` (``<run_id>_<random>/attempt_<round>/<local_rank>/{stdout,stderr}.log``).

These run the launcher in-process (``main(argv)``, as the console script does) to save the
launcher's start-up; the workers are real processes all the same.
"""

from __future__ import annotations

import pytest

from fastcomm.launch.cli import main

from ._util import script


@pytest.mark.timeout(60)
def test_prefixes_redirects_and_tee(tmp_path, capfd):
    path = script(
        tmp_path,
        "talk.py",
        """
        import os, sys
        rank = os.environ["RANK"]
        for i in range(3):
            print(f"out {rank} line {i}")
        print(f"err {rank}", file=sys.stderr)
        sys.stdout.write(f"tail {rank} without newline")
    """,
    )
    logs = tmp_path / "logs"
    # local rank 0: stdout+stderr only to files; local rank 1: stdout to file and console
    code = main(
        [
            "--nproc-per-node",
            "3",
            "--log-dir",
            str(logs),
            "--redirects",
            "0:3",
            "--tee",
            "1:1",
            str(path),
        ]
    )
    captured = capfd.readouterr()
    assert code == 0, captured.err
    out, err = captured.out.splitlines(), captured.err.splitlines()
    for rank in (1, 2):
        assert [f"[rank {rank}]: out {rank} line {i}" for i in range(3)] == [
            line for line in out if line.startswith(f"[rank {rank}]: out")
        ]
        assert f"[rank {rank}]: tail {rank} without newline" in out
        assert f"[rank {rank}]: err {rank}" in err
    assert not [line for line in out + err if line.startswith("[rank 0]")]
    [run_dir] = logs.iterdir()
    attempt = run_dir / "attempt_0"
    assert (attempt / "0" / "stdout.log").read_text() == (
        "out 0 line 0\nout 0 line 1\nout 0 line 2\ntail 0 without newline"
    )
    assert (attempt / "0" / "stderr.log").read_text() == "err 0\n"
    assert (attempt / "1" / "stdout.log").read_text().startswith("out 1 line 0\n")
    assert not (attempt / "1" / "stderr.log").exists()
    assert not (attempt / "2" / "stdout.log").exists()


@pytest.mark.timeout(60)
def test_line_prefix_template_ranks_filter_and_no_python(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "<${role_name}${local_rank}> ")
    code = main(
        [
            "--nproc-per-node",
            "2",
            "--local-ranks-filter",
            "1",
            "--role",
            "w",
            "--no-python",
            "sh",
            "-c",
            'echo "hello $RANK of $WORLD_SIZE"',
        ]
    )
    captured = capfd.readouterr()
    assert code == 0, captured.err
    assert captured.out.splitlines() == ["<w1> hello 1 of 2"]


def test_carriage_returns_redraw_in_place_with_prefix(tmp_path):
    import io

    from fastcomm.launch.workers import _pump

    # tqdm starts with a bare \r: it must not leave a prefix of its own ("[rank 0]: [rank 0]: ")
    raw = b"\rbar 10%\rbar 50%\rbar 100%\ndone\nno newline"
    src = io.BufferedReader(io.BytesIO(raw))
    console, copy = io.BytesIO(), io.BytesIO()
    _pump(src, b"[rank 0]: ", console, copy)
    assert console.getvalue() == (
        b"\r[rank 0]: bar 10%\r[rank 0]: bar 50%\r[rank 0]: bar 100%\n"
        b"[rank 0]: done\n[rank 0]: no newline\n"
    )
    assert copy.getvalue() == raw
