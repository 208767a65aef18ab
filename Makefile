# fp8blk: `make demo` runs the demo, `make test` the test suite. Each creates its own virtual
# environment (.venv, pip only) on first use and reinstalls when setup.cfg changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# notebook: the tests execute examples/kernels.ipynb. On a machine with an NVIDIA driver, also
# install CuPy so the demo runs on the GPU.
EXTRAS := test,torch,notebook$(shell command -v nvidia-smi >/dev/null 2>&1 && echo ,gpu)

.PHONY: demo test bench info clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m fp8blk demo
	$(VENV)/bin/mpiexec -n 4 $(PY) -m mpi4py -m fp8blk demo --distributed

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) -m fp8blk bench

info: $(VENV)/.installed
	$(PY) -m fp8blk info

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
