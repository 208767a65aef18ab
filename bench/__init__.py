"""GPU benchmarks of fp8blk (not installed). Run from the repository root: python -m bench.<name>.
Shared here: result file names and the sectioned result files (one file per benchmark and
machine, one section per mode of a run)."""
import json
import os


def machine(gpu_name, gpus=1):
    """The machine part of a result's file name, ``<benchmark>-<machine>.json``: the last word
    of the GPU's name in lower case, with ``x<gpus>`` when several take part ("NVIDIA H200", 2
    -> "h200x2"), as ``bench/run_gpu.sh`` names them."""
    name = gpu_name.decode() if isinstance(gpu_name, bytes) else str(gpu_name)
    return name.split()[-1].lower() + (f"x{gpus}" if gpus > 1 else "")


def sections(result, cases="cases"):
    """{section: run} of a sectioned result (see :func:`write_section`), each run with its own
    fields and its cases under `cases`; a result of one run without sections is {None: it}."""
    if "runs" not in result:
        return {None: result}
    return {run["section"]: {**run, cases: [c for c in result[cases]
                                            if c.get("section") == run["section"]]}
            for run in result["runs"]}


def write_section(path, section, run, cases="cases"):
    """Write `run` (a dict: machine, date, command, ..., its cases under `cases`) as `section`
    of the result file `path`: ``{"runs": [each run's fields and "section"], cases: [every
    run's cases, each with "section"]}``. The run replaces its own section's run and cases;
    the other sections stay as they are (a file in another layout is replaced)."""
    old = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = sections(json.load(f), cases)
        except (OSError, ValueError, KeyError, TypeError):
            old = {}
    old.pop(None, None)
    old[section] = run
    result = {"runs": [], cases: []}
    for name, each in old.items():
        result["runs"].append({"section": name, **{k: v for k, v in each.items()
                                                   if k not in (cases, "section")}})
        result[cases] += [{"section": name, **{k: v for k, v in c.items() if k != "section"}}
                          for c in each[cases]]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(result, indent=1) + "\n")
    return result
