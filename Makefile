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
# pytest-xdist: a file's tests on one worker (its module-scoped spawns run once), the files in collection
# order, which tests/conftest.py makes the longest first (tests.harness.schedule)
DIST ?= --dist loadfile --no-loadscope-reorder

.PHONY: venv demo test test-unit test-distributed lint clean

venv: $(STAMP)

# --no-compile: pip writes no .pyc for the ~15,000 modules of each environment (measured: 2.5 ms of CPU each,
# most never imported); Python compiles what is imported on first use and keeps it, unless
# PYTHONDONTWRITEBYTECODE is set (it is on these machines: .ci/run unsets it, docs/testing.md)
$(STAMP): requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-compile --upgrade pip 'setuptools>=77'
	$(PIP) install -q --no-compile $(TORCH_PIN)
	# megatron-core declares heavy optional deps; it runs on CPU with numpy + packaging.
	$(PIP) install -q --no-compile --no-deps $(MEGATRON_PIN)
	# Constraints hold torch at the build installed above: peft and accelerate require torch; should
	# one of them (or a later pin) want a torch this build does not satisfy, pip fails here instead of
	# replacing it with another build from the index (a CUDA wheel of several GB).
	echo '$(TORCH_PIN)' > $(VENV)/constraints.txt
	$(PIP) install -q --no-compile -c $(VENV)/constraints.txt -r requirements-dev.txt
	# torchtitan (tests/*/torchtitan): its own pins without its declared dependencies (datasets, tensorboard,
	# wandb, ...: not imported by what the tests run); tyro & co. come from requirements-dev.txt.
	$(PIP) install -q --no-compile --no-deps -c $(VENV)/constraints.txt torchtitan==0.3.0 spmd_types==0.2.3
	$(PIP) install -q --no-compile --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: venv
	$(PY) -m regather demo

test: venv
	$(PY) -m pytest -q -n $(JOBS) $(DIST) tests

# the tests that run in-process (tests/unit), and those that spawn gloo ranks (tests/distributed, marker `distributed`)
test-unit: venv
	$(PY) -m pytest -q -n $(JOBS) $(DIST) tests/unit

test-distributed: venv
	$(PY) -m pytest -q -n $(JOBS) $(DIST) tests/distributed

# ruff (pyproject.toml [tool.ruff]) and the layering contracts (pyproject.toml [tool.importlinter]):
# tools > hf > front ends > core > ops, MoE above the dense front end, no import cycle
lint: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

# The distributed and integration tests (megatron's DDP, optimizer, schedules, dist_checkpointing)
# against megatron-core 0.19.2, which declares Python 3.12. Where Python 3.12 is found they run in
# the 3.12 tier's venv (.venv312, .ci/venv312.sh), megatron-core 0.19.2 installed there as a package
# (tests/distributed/torchtitan imports no megatron and runs in make test; the Bridge and recipe tiers have
# their own targets). Without Python 3.12: megatron-core 0.19.2 placed beside the 3.11 stack with
# PYTHONPATH (design.md §6; it imports triton), which make test-bridge uses in any case.
# Which files: those of tests/distributed whose import closure reaches megatron (tests.harness.tiers: a file
# that reaches no megatron module runs the same code on any megatron-core and ran in make test).
COMPAT_DIR := .venv-compat/mcore019
COMPAT_PIN := megatron-core==0.19.2
VENV312 := .venv312
TIERS := -m tests.harness.tiers

$(COMPAT_DIR)/.installed: $(STAMP)
	$(PIP) install -q --no-compile --no-deps --ignore-requires-python --target $(COMPAT_DIR) \
		--python-version 3.12 --only-binary=:all: $(COMPAT_PIN)
	touch $@

.PHONY: test-compat test-compat-311
test-compat:
	@.ci/venv312.sh $(VENV312); rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "make test-compat: no Python 3.12 here: megatron-core 0.19.2 beside the 3.11 stack instead"; \
		exec $(MAKE) --no-print-directory test-compat-311; fi; \
	[ $$rc -eq 0 ] || exit $$rc
	PYTHONPATH=src $(VENV312)/bin/python -c "import megatron.core as m, sys; \
		assert m.__version__.startswith('0.19.2'), m.__version__; print('megatron-core', m.__version__, 'installed, Python', sys.version.split()[0])"
	files=$$($(VENV312)/bin/python $(TIERS) compat) && [ -n "$$files" ] && \
		PYTHONPATH=src $(VENV312)/bin/python -m pytest -q -n $(JOBS) $(DIST) $$files

test-compat-311: $(COMPAT_DIR)/.installed
	PYTHONPATH=$(COMPAT_DIR) $(PY) -c "import megatron.core as m; assert m.__version__.startswith('0.19.2'), m.__version__"
	files=$$($(PY) $(TIERS) compat) && [ -n "$$files" ] && \
		PYTHONPATH=$(COMPAT_DIR) $(PY) -m pytest -q -n $(JOBS) $(DIST) $$files

# The tests against the real Megatron Bridge (tests/*/megatron/bridge; ~2 min on 2 cores). megatron-bridge 0.6.2 is a
# pure-Python wheel that declares Python 3.12 and a GPU stack: it goes beside the pinned stack like
# megatron-core 0.19.2 (--no-deps, --ignore-requires-python), and tests.harness.bridge_env adds the
# import-level shims its PEFT code needs on CPU. Bridge 0.6.2 pins no megatron-core version
# (megatron-core[dev,mlm]), but its PEFT code imports megatron.core.models.hybrid.hybrid_block, which
# megatron-core has from 0.18 on (not in 0.17.1 nor 0.16.1): the tests run with 0.19.2 on the path;
# tests/distributed/megatron/bridge/test_bridge_mcore016.py checks the pinned 0.16.1 too (with a HybridStack stand-in).
BRIDGE_DIR := .venv-compat/bridge
BRIDGE_PIN := megatron-bridge==0.6.2
BRIDGE_PATH := $(BRIDGE_DIR):$(COMPAT_DIR)

$(BRIDGE_DIR)/.installed: $(STAMP)
	rm -rf $(BRIDGE_DIR)
	$(PIP) install -q --no-compile --no-deps --ignore-requires-python --target $(BRIDGE_DIR) \
		--python-version 3.12 --only-binary=:all: $(BRIDGE_PIN)
	touch $@

.PHONY: test-bridge
test-bridge: $(BRIDGE_DIR)/.installed $(COMPAT_DIR)/.installed
	PYTHONPATH=$(BRIDGE_PATH) $(PY) -c "import importlib.metadata as md; \
		v = md.version('megatron-bridge'), md.version('megatron-core'); assert v == ('0.6.2', '0.19.2'), v"
	PYTHONPATH=$(BRIDGE_PATH) $(PY) -m pytest -q -n $(JOBS) $(DIST) tests/unit/megatron/bridge tests/distributed/megatron/bridge

# The Python 3.12 tier (docs/testing.md): Megatron Bridge 0.6.2's own recipes as users run them, on
# the real megatron-bridge 0.6.2 and megatron-core 0.19.2 installed as packages in .venv312
# (.ci/venv312.sh builds it from requirements-py312.txt; never Transformer Engine). Skipped, saying
# so, where this machine has no Python 3.12.

.PHONY: test-recipes
test-recipes:
	@.ci/venv312.sh $(VENV312); rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "make test-recipes: skipped (no Python 3.12 on this machine)"; exit 0; fi; \
	[ $$rc -eq 0 ] || exit $$rc
	PYTHONPATH=src $(VENV312)/bin/python -m pytest -q -p no:cacheprovider -n $(JOBS) $(DIST) tests/unit/recipes tests/distributed/recipes

# The torch 2.14 tier (docs/testing.md): the tests of what touches torch's moving surface (tests.harness.tiers
# TORCH_TIER: regather.core, the kernels, torchtitan, torch.compile, each with its reason) on
# torch 2.14.1+cu130 (on CPU) and triton 3.8.0, with the same assertions as on 2.13; the CUDA extension
# regather._wgrad_ext built for sm_90 against that torch and this machine's CUDA toolkit
# (.ci/build-ext.sh, into $(EXT214), git-ignored) and checked by tests/unit/ops/test_wgrad_ext_build.py;
# the Triton kernels compiled for sm_90 by tests/unit/ops/test_wgrad_sm90.py (in tests/unit). The
# environment: .ci/venv-torch214.sh from requirements-torch214.txt (Python 3.11; regather from src/).
# Skipped, saying so, without Python 3.11; without a CUDA toolkit the extension's tests skip, unless
# CUDA_TOOLKIT=required (.ci/run), which makes that a failure.
VENV214 := .venv-torch214
EXT214 := build/ext-torch214
CUDA_TOOLKIT ?= optional

.PHONY: test-torch214
test-torch214:
	@.ci/venv-torch214.sh $(VENV214); rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "make test-torch214: skipped (no Python 3.11 on this machine)"; exit 0; fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	.ci/build-ext.sh $(VENV214) $(EXT214); rc=$$?; \
	if [ $$rc -eq 3 ] && [ "$(CUDA_TOOLKIT)" != required ]; then \
		echo "make test-torch214: regather._wgrad_ext not built: its tests skip"; \
	elif [ $$rc -ne 0 ]; then exit $$rc; fi; \
	set -f; tests=$$($(VENV214)/bin/python $(TIERS) torch214) && [ -n "$$tests" ] || exit 1; \
	echo "PYTHONPATH=src REGATHER_EXT_BUILD=$(EXT214) $(VENV214)/bin/python -m pytest -q -n $(JOBS) $(DIST) "$$tests; \
	PYTHONPATH=src REGATHER_EXT_BUILD=$(EXT214) $(VENV214)/bin/python -m pytest -q -n $(JOBS) $(DIST) $$tests
