# Two entry points: `make demo` and `make test`. Each builds .venv with the
# pinned CPU stack when it is missing (or when the pins change), then runs.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.regather-installed

TORCH_PIN    := torch==2.13.0
MEGATRON_PIN := megatron-core==0.16.1
JOBS ?= 2

.PHONY: venv demo test test-unit test-distributed clean

venv: $(STAMP)

$(STAMP): requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip 'setuptools>=77'
	$(PIP) install -q $(TORCH_PIN)
	# megatron-core declares heavy optional deps; it runs on CPU with numpy + packaging.
	$(PIP) install -q --no-deps $(MEGATRON_PIN)
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: venv
	$(PY) -m regather demo

test: venv
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile tests

test-unit: venv
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile tests/unit

test-distributed: venv
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile tests/distributed

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

# The distributed tests against megatron-core 0.19.2 (needs Python 3.12 on paper; it runs on
# 3.11 when placed beside the pinned stack with PYTHONPATH, design.md §6; it imports triton).
COMPAT_DIR := .venv-compat/mcore019
COMPAT_PIN := megatron-core==0.19.2

$(COMPAT_DIR)/.installed: $(STAMP)
	$(PIP) install -q --no-deps --ignore-requires-python --target $(COMPAT_DIR) \
		--python-version 3.12 --only-binary=:all: $(COMPAT_PIN)
	touch $@

.PHONY: test-compat
test-compat: $(COMPAT_DIR)/.installed
	PYTHONPATH=$(COMPAT_DIR) $(PY) -c "import megatron.core as m; assert m.__version__.startswith('0.19.2'), m.__version__"
	PYTHONPATH=$(COMPAT_DIR) $(PY) -m pytest -q -n $(JOBS) --dist loadfile tests/distributed
