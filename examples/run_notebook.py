"""Run a notebook's code cells as one plain Python script, without Jupyter.

    python examples/run_notebook.py examples/kernels.ipynb [--figures DIR]

For machines that have matplotlib but no Jupyter kernel (nbclient, ipykernel): the code cells
run in order in one namespace, their printed output goes to stdout, each ``plt.show()`` saves
the figure as DIR/figure-N.png (with ``--figures``; else it is closed), and the first failing
cell (an ``assert`` included) stops the run with exit status 1 and names the cell. The
notebook file is not modified. IPython syntax (``%magic``, ``!shell``) is not supported.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebook")
    parser.add_argument("--figures", metavar="DIR", help="save each shown figure here as PNG")
    args = parser.parse_args(argv)
    if args.figures:
        args.figures = os.path.abspath(args.figures)  # before the chdir below
    with open(args.notebook) as f:
        cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]

    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib.pyplot as plt

    shown = []

    def show(*_, **__):
        for number in plt.get_fignums():
            if args.figures:
                os.makedirs(args.figures, exist_ok=True)
                path = os.path.join(args.figures, f"figure-{len(shown) + 1}.png")
                plt.figure(number).savefig(path, dpi=100)
                print(f"[figure saved: {path}]")
            shown.append(number)
        plt.close("all")
    plt.show = show

    # relative paths in the notebook resolve from its own folder, as in Jupyter
    os.chdir(os.path.dirname(os.path.abspath(args.notebook)))
    namespace = {"__name__": "__main__"}
    for index, cell in enumerate(cells, 1):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        print(f"--- cell {index}/{len(cells)}", flush=True)
        try:
            exec(compile(source, f"<cell {index}>", "exec"), namespace)
        except Exception:
            traceback.print_exc()
            print(f"FAILED in code cell {index}", flush=True)
            return 1
        sys.stdout.flush()
    print(f"all {len(cells)} code cells ran; {len(shown)} figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
