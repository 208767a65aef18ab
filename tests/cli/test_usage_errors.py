"""Every input error of ``python -m fp8blk`` is a usage message: exit status 2, one error line
naming the option, no traceback, and no work done before it."""
import os
import subprocess
import sys
import types

import pytest

from fp8blk.cli import main
from fp8blk.cli import demo as cli_demo

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _usage_error(argv, capsys):
    """The error line of a usage error (asserts exit status 2 and no output on stdout)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.strip().splitlines()[-1]


@pytest.fixture
def unwritable(tmp_path):
    """A path below a regular file: no process can make a folder there (root included)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return str(blocker / "sub")


@pytest.mark.parametrize("args, match", [
    (["--shape", "0", "128"], "positive integer, got 0"),
    (["--shape", "-4", "128"], "positive integer, got -4"),
    (["--shape", "x", "128"], "positive integer, got 'x'"),
    (["--seed", "-1"], "integer >= 0"),
])
def test_demo_arguments_are_checked(args, match, capsys):
    assert match in _usage_error(["demo", "--cpu"] + args, capsys)


def test_demo_refuses_a_shape_that_cannot_fit(capsys):
    line = _usage_error(["demo", "--cpu", "--shape", "100000000", "100000000"], capsys)
    assert "--shape 100000000 100000000 needs about" in line and "GiB" in line
    assert "choose a smaller shape" in line


def test_demo_shape_check_counts_the_memory_it_needs(monkeypatch):
    monkeypatch.setattr(cli_demo, "_host_available", lambda: 2**30)
    assert cli_demo.check_shape((1024, 1024), cpu=True) is None
    assert "this host has 1.0 GiB" in cli_demo.check_shape((8192, 8192), cpu=True)
    # on a GPU its free memory counts too
    monkeypatch.setattr(cli_demo, "_host_available", lambda: 2**40)
    runtime = types.SimpleNamespace(memGetInfo=lambda: (2**30, 2**31))
    gpu = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(cli_demo, "gpu_module", lambda: gpu)
    assert "the GPU has 1.0 GiB" in cli_demo.check_shape((16384, 16384), cpu=False)
    assert cli_demo.check_shape((16384, 16384), cpu=True) is None


def test_distributed_demo_refuses_shape(capsys):
    line = _usage_error(["demo", "--distributed", "--shape", "64", "64"], capsys)
    assert "--shape applies to the single-process demo" in line


def test_demo_runs_on_a_shape_mxfp8_cannot_take(capsys):
    assert main(["demo", "--cpu", "--shape", "100", "100"]) == 0
    out = capsys.readouterr().out
    assert "MXFP8 E4M3    skipped: MXFP8 needs M and K to be multiples of 32" in out
    assert "Block2D E4M3" in out


@pytest.mark.parametrize("args, match", [
    (["--reps", "-2"], "--reps: expected a positive integer, got -2"),
    (["--reps", "0"], "--reps: expected a positive integer, got 0"),
    (["--sizes", "64", "-1"], "--sizes: expected a positive integer, got -1"),
    (["--cases", "b1d_sideways"], "unknown --cases b1d_sideways; choose from"),
])
def test_bench_arguments_are_checked(args, match, capsys):
    assert match in _usage_error(["bench", "--cpu"] + args, capsys)


def test_bench_checks_out_before_running(unwritable, capsys, monkeypatch):
    from fp8blk.cli import bench

    monkeypatch.setattr(bench, "run", lambda args: pytest.fail("the benchmark ran"))
    line = _usage_error(["bench", "--cpu", "--out", unwritable], capsys)
    assert line.endswith("cannot write there (Not a directory)") and "--out" in line


def test_prebuild_jobs_must_be_positive(capsys):
    assert "--jobs: expected a positive integer, got 0" in _usage_error(
        ["prebuild", "--jobs", "0"], capsys)


@pytest.mark.parametrize("cc", ["abc", "9", "9.x", ""])
def test_prebuild_cc_must_parse(cc, capsys):
    assert "--cc must look like 90 or 9.0" in _usage_error(["prebuild", "--cc", cc], capsys)


@pytest.mark.parametrize("cc", ["75", "8.0", "86", "sm_80"])
def test_prebuild_refuses_unsupported_compute_capabilities(cc, capsys):
    line = _usage_error(["prebuild", "--cc", cc], capsys)
    assert "is not supported" in line and "89, 90, 100, 120" in line


def test_prebuild_checks_dir_and_cache_switch(unwritable, tmp_path, capsys, monkeypatch):
    from fp8blk.cli import prebuild

    monkeypatch.setattr(prebuild, "prebuild", lambda *a, **k: pytest.fail("prebuild ran"))
    line = _usage_error(["prebuild", "--cc", "90", "--dir", unwritable], capsys)
    assert "--dir" in line and "cannot write there" in line
    monkeypatch.setenv("FP8BLK_KERNEL_CACHE", "0")
    line = _usage_error(["prebuild", "--dir", str(tmp_path)], capsys)
    assert "FP8BLK_KERNEL_CACHE=0 turns the kernel cache off" in line


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"],
                                  ["info", "--help"], ["prebuild", "--help"]])
def test_help_is_plain_text(argv):
    """Help reads as plain text: no reStructuredText literals, roles or directives."""
    out = subprocess.run([sys.executable, "-m", "fp8blk"] + argv, cwd=_REPO, check=True,
                         capture_output=True, text=True).stdout
    assert out.startswith("usage: python -m fp8blk")
    for rst in ("``", ":func:", ":class:", "::\n"):
        assert rst not in out, (rst, out)


def test_usage_error_from_the_shell_has_no_traceback():
    done = subprocess.run([sys.executable, "-m", "fp8blk", "bench", "--reps", "-2"], cwd=_REPO,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("python -m fp8blk bench: error: argument "
                                                    "--reps: expected a positive integer, got -2")
