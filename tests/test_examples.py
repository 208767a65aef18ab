"""The user-facing examples run and their own checks pass (CPU, small sizes).

* ``examples/weights_pipeline.py`` under ``mpiexec -n 4`` (MPI, NumPy): its checks compare the
  sharded pipeline with a single-rank computation byte for byte and exit 1 on a mismatch;
* ``examples/kernels.ipynb`` executed with nbclient (its cells ``assert`` what they show);
  skipped when the optional notebook packages are absent (``pip install 'fp8blk[notebook]'``);
* ``python -m fp8blk bench --cpu`` writes its JSON (and a PNG with matplotlib, or says that the
  plot was skipped without it);
* ``examples/train_fsdp2.py`` and ``examples/tensor_parallel.py`` under torchrun (2 processes,
  gloo), when ``fp8blk.torch`` has the adapters they use.

Every launch runs under a hard timeout (tests/comm/launch.py).
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.comm import launch

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
# one BLAS thread per process: 4 ranks share CI's 2 cores
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_weights_pipeline_on_4_ranks():
    pytest.importorskip("mpi4py")
    command = launch.mpiexec_command() + ["-n", "4", sys.executable, "-m", "mpi4py",
                                          str(EXAMPLES / "weights_pipeline.py"), "--steps", "2"]
    code, output, _ = launch.run(command, timeout=120, env=ONE_THREAD)
    assert code == 0, output[-6000:]
    assert "checks: " in output and output.rstrip().endswith("PASSED"), output[-3000:]
    # the weight all-gather sends 1 byte per element where bf16 would send 2
    gather = re.search(r"^gather\s+[\d.]+\s+([\d,]+)\s+([\d,]+)", output, re.M)
    assert gather, output[-3000:]
    fp8, bf16 = (int(g.replace(",", "")) for g in gather.groups())
    assert fp8 > 0 and 2 * fp8 == bf16, output[-3000:]


def _bench(tmp_path, *extra):
    from fp8blk.__main__ import main

    return main(["bench", "--cpu", "--sizes", "64", "128", "--reps", "1", "--cases",
                 "b1d_row", "b2d_both", "mx_col", "b2d_transpose", "b1d_dequant_col",
                 "--out", str(tmp_path), *extra])


def _check_report(tmp_path):
    (path,) = tmp_path.glob("bench-cpu-*.json")
    report = json.loads(path.read_text())
    assert report["device"] == "cpu" and report["sizes"] == [64, 128]
    assert set(report["copy_bytes_per_s"]) == {"64", "128"}
    rows = report["results"]
    assert sorted({r["case"] for r in rows}) == sorted(
        ["b1d_row", "b2d_both", "mx_col", "b2d_transpose", "b1d_dequant_col"])
    assert len(rows) == 10 and all(r["kind"] == "fp8blk reference (CPU)" for r in rows)
    for r in rows:
        n = r["shape"][0]
        assert r["seconds"] > 0 and r["tb_s"] > 0
        assert r["bytes"] > n * n  # at least the FP8 bytes of an N x N tensor
    # b1d_row moves the float32 input, the FP8 bytes and cdiv(N,128) x round4(N) fp32 scales
    row = next(r for r in rows if r["case"] == "b1d_row" and r["shape"][0] == 128)
    assert row["bytes"] == 128 * 128 * 4 + 128 * 128 + 1 * 128 * 4
    return path


def test_bench_cpu_writes_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib missing: pip install 'fp8blk[plot]'")
    assert _bench(tmp_path) == 0
    out = capsys.readouterr().out
    assert "CPU REFERENCE PATH" in out
    json_path = _check_report(tmp_path)
    png = json_path.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_without_matplotlib_writes_json_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert _bench(tmp_path) == 0
    assert "plot skipped: matplotlib is not installed" in capsys.readouterr().out
    _check_report(tmp_path)
    assert not list(tmp_path.glob("*.png"))


def test_bench_rejects_unknown_cases(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _bench(tmp_path, "--cases", "b1d_sideways")
    assert exit_info.value.code == 2 and "unknown --cases" in capsys.readouterr().err


def test_committed_notebook_has_cpu_outputs():
    """The notebook is committed executed (readers see the plots without running it)."""
    nb = json.loads((EXAMPLES / "kernels.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["execution_count"] is not None for c in code)
    assert not [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    images = [o for c in code for o in c["outputs"] if "image/png" in o.get("data", {})]
    assert len(images) >= 3


@pytest.mark.timeout(240)
def test_notebook_executes(monkeypatch, tmp_path):
    for name in ("nbclient", "nbformat", "ipykernel", "matplotlib"):
        pytest.importorskip(name, reason=f"{name} missing: pip install 'fp8blk[notebook]'")
    import nbformat
    from nbclient import NotebookClient

    # the kernel is a child process: it must import this checkout's fp8blk
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))  # connection files: not in $HOME
    for name, value in ONE_THREAD.items():
        monkeypatch.setenv(name, value)
    nb = nbformat.read(EXAMPLES / "kernels.ipynb", as_version=4)
    # a cell that fails (an assert included) raises CellExecutionError here
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs)
    assert "every element within its rounding bound" in text
    assert "equals quantize(columnwise=True) byte for byte" in text


def _torchrun_example(script, *args, timeout=150):
    pytest.importorskip("torch.distributed")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(EXAMPLES / script), *args]
    code, output, _ = launch.run(command, timeout, dict(ONE_THREAD,
                                                        PYTHONWARNINGS="ignore::FutureWarning"))
    assert code == 0, output[-6000:]
    assert re.search(r"^checks: PASSED$", output, re.M), output[-3000:]
    return output


@pytest.mark.timeout(180)
def test_tensor_parallel_on_2_ranks():
    pytest.importorskip("fp8blk.torch.tensor_parallel")
    # hidden/2 = 128 (tile-aligned shards), 64 positions x batch 2 = 128 tokens per rank
    output = _torchrun_example("tensor_parallel.py", "--steps", "1", "--d-model", "128",
                               "--hidden", "256", "--seq", "128")
    # every check line printed ok, none FAIL; the activations went over the wire as FP8
    assert "FAIL" not in output and output.count("  ok   ") == 9, output[-3000:]
    assert "{'fast': 3}" in output


@pytest.mark.timeout(180)
def test_train_fsdp2_on_2_ranks():
    pytest.importorskip("fp8blk.torch.fsdp")
    output = _torchrun_example("train_fsdp2.py", "--steps", "12")
    assert "FAIL" not in output and output.count("  ok   ") == 4, output[-3000:]
    assert "checkpoint): same loss" in output


def test_run_notebook_runs_cells_saves_figures_and_stops_at_a_failure(tmp_path):
    """examples/run_notebook.py (the notebook without Jupyter, e.g. on the GPU machine)."""
    pytest.importorskip("matplotlib", reason="matplotlib missing: pip install 'fp8blk[plot]'")

    def notebook(*sources):
        cells = [{"cell_type": "markdown", "source": "# t", "metadata": {}}] + [
            {"cell_type": "code", "source": s, "metadata": {}, "outputs": [],
             "execution_count": None} for s in sources]
        path = tmp_path / f"nb{len(list(tmp_path.glob('*.ipynb')))}.ipynb"
        path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                    "nbformat_minor": 5}))
        return str(path)

    script = str(EXAMPLES / "run_notebook.py")
    good = notebook("import matplotlib.pyplot as plt\nv = 41",
                    "plt.plot([1, 2]); plt.show()\nprint('value', v + 1)")
    code, out, _ = launch.run([sys.executable, script, good, "--figures",
                               str(tmp_path / "figs")], timeout=60)
    assert code == 0, out
    assert "value 42" in out and "all 2 code cells ran; 1 figures" in out
    assert (tmp_path / "figs" / "figure-1.png").read_bytes()[:4] == b"\x89PNG"
    bad = notebook("x = 1", "assert x == 2, 'planted'", "print('not reached')")
    code, out, _ = launch.run([sys.executable, script, bad], timeout=60)
    assert code == 1 and "FAILED in code cell 2" in out and "planted" in out, out
    assert "not reached" not in out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("script", ["hf_llama.py", "hf_moe.py"])
def test_hf_example(script):
    pytest.importorskip("transformers", reason="transformers missing: "
                        "pip install 'fp8blk[transformers]'")
    code, output, _ = launch.run([sys.executable, str(EXAMPLES / script)], timeout=150,
                                 env=ONE_THREAD)
    assert code == 0, output[-6000:]
    assert "FAIL" not in output and output.count("  ok   ") == 3, output[-3000:]
    assert re.search(r"^checks: PASSED$", output, re.M), output[-3000:]
