# Two entry points: `make demo` (install + the main job) and `make test` (install + the tests).
# The demo installs only what it runs; the tests add the dev tools (pytest, ruff, Triton for the kernels).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip -q --disable-pip-version-check
# uv installs the same packages as pip (pip's own configuration carried over: tools/with_pip_config.py) in
# seconds where pip takes minutes; where uv cannot be had, pip does it.
INSTALL = if [ -x $(VENV)/bin/uv ]; then $(PY) tools/with_pip_config.py $(VENV)/bin/uv pip install -q \
	--python $(PY) $(1); else PYTHONWARNINGS=ignore $(PIP) install $(1); fi

.PHONY: install install-dev demo test test-grid-order test-slow test-engines wheel-check lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	PYTHONWARNINGS=ignore $(PIP) install uv || echo "uv not available: installing with pip (minutes)"
	# CPU build of torch from the local wheel cache; a GPU user installs their CUDA torch first instead.
	$(PY) -c "import torch" 2>/dev/null || $(call INSTALL,torch==2.13.0)
	$(call INSTALL,-e .)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(call INSTALL,-e ".[dev]")
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

demo: install
	$(VENV)/bin/dsaindex demo

test: install-dev
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow"

# the kernels' tests again with the interpreter's programs in a shuffled order, as a GPU may run them (tests/conftest.py)
KERNEL_TESTS := tests/test_kernel_select.py tests/test_kernel_topk.py tests/test_kernel_ivf_select.py \
	tests/test_paged_select.py tests/test_pq_batch.py tests/test_pq_decode.py tests/test_causal_ivf.py \
	tests/test_ivf_prefill.py tests/test_streaming.py tests/test_rq_serving.py
test-grid-order: install-dev
	DSAINDEX_GRID_ORDER=shuffle TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow" $(KERNEL_TESTS)

# the end-to-end runs of real subprocesses (kills, Ctrl-C, the HTTP server), apart from the main suite
test-slow: install-dev
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m slow

# the SGLang and vLLM plugins' contract tests, each in its own virtualenv with the engine's real code
test-engines:
	bash engines/sglang/ci.sh -q
	bash engines/vllm/ci.sh -q

# the wheel built from this tree, installed in a clean virtualenv, running a capture, training and the check
wheel-check:
	bash .ci/wheel_check.sh

lint: install-dev
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .venv-sglang .venv-vllm runs .pytest_cache
