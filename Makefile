# One-command setup: `make test` and `make demo` create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU build this machine carries; an unpinned torch pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: install test test-fast demo lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" -e ".[test]"
	touch $@

install: $(VENV)/.installed

test: install
	RAY_AUTH_MODE=disabled $(PY) -m pytest -q tests

test-fast: install
	RAY_AUTH_MODE=disabled $(PY) -m pytest -q tests/unit

demo: install
	RAY_AUTH_MODE=disabled $(VENV)/bin/posttrain demo

lint: install
	$(VENV)/bin/ruff check posttrain tests benchmarks

bench: install
	RAY_AUTH_MODE=disabled $(PY) benchmarks/train_generate.py

clean:
	rm -rf $(VENV) results .pytest_cache
