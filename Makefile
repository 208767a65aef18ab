# fp8blk: `make demo` runs the demo, `make test` the test suite. Each creates its own virtual
# environment (.venv, pip only) on first use and reinstalls when setup.cfg changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# notebook: the tests execute examples/kernels.ipynb; transformers: they build tiny Hugging Face
# models from configs. On a machine with an NVIDIA driver, also
# install the gpu extra (Numba-CUDA's CUDA 13 wheels, CuPy) so the demo runs on the GPU.
HAVE_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
comma := ,
EXTRAS := test,torch,notebook,transformers$(if $(HAVE_GPU),$(comma)gpu)
TORCH := torch==2.13.0
# Without an NVIDIA driver, torch's CPU build from PyTorch's CPU index: the default Linux build
# of the same version brings about 20 CUDA library packages (several GB). Where that index cannot be reached,
# pip's own sources (which may hold a CPU wheel) are used.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# --no-compile: Python writes bytecode for the modules it imports, not all ~240 MB of it
PIP := $(PY) -m pip install --progress-bar on --no-compile

.PHONY: demo test bench info clean

$(VENV)/.installed: setup.cfg pyproject.toml
	@echo "==> [1/4] creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/4] upgrading pip"
	$(PIP) --upgrade pip
	@echo "==> [3/4] installing $(TORCH) ($(if $(HAVE_GPU),CUDA build: nvidia-smi found,CPU build: no nvidia-smi))"
ifeq ($(HAVE_GPU),)
	@if $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=15)" 2>/dev/null; then \
		echo "$(PIP) --index-url $(TORCH_CPU_INDEX) $(TORCH)"; \
		$(PIP) --index-url $(TORCH_CPU_INDEX) "$(TORCH)" || $(PIP) "$(TORCH)"; \
	else \
		echo "    $(TORCH_CPU_INDEX) cannot be reached: installing $(TORCH) from pip's configured sources"; \
		$(PIP) "$(TORCH)"; \
	fi
else
	$(PIP) "$(TORCH)"
endif
	@echo "==> [4/4] installing fp8blk (editable) with extras [$(EXTRAS)]"
	$(PIP) -e ".[$(EXTRAS)]"
	@touch $@
	@echo "==> $(VENV) ready ($$(du -sh $(VENV) | cut -f1)); activate it with: source $(VENV)/bin/activate"

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
