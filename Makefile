# Two commands do all the set-up on a fresh machine:
#   make demo   - a server, a training run that goes wrong, and an agent that finds and fixes it
#   make test   - the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU wheel this machine has on disk; a looser pin would download a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv demo test clean

# The demo needs the server (the `server` extra); the tests need the test extra on top of it.
$(VENV)/.server: pyproject.toml setup.py probes/_fastats.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[server]" "$(TORCH_PIN)"
	touch $@

$(VENV)/.installed: $(VENV)/.server
	$(PY) -m pip install -q -e ".[test]" "$(TORCH_PIN)"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.server
	$(VENV)/bin/traindx demo

test: venv
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .traindx .pytest_cache
