# Two entry points: `make demo` (install + the main job) and `make test` (install + the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: install demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU build of torch from the local wheel cache; a GPU user installs their CUDA torch first instead.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/dsaindex demo

test: install
	TRITON_INTERPRET=1 $(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
