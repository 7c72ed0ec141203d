# `make test` runs the suite on every supported torch version, each in its own venv, two versions at a
# time (TEST_JOBS; the output of each comes whole). The newest tested torch is the default venv (demo,
# bench). Tests marked `slow` (fresh processes, Inductor compiles: ~60% of a version's time on a 2-core
# machine) run on FULL_VERSIONS (the newest and the oldest, whose code paths differ most); the versions
# between run the rest, which keeps CI well inside its time limit (the GPU machines run the whole
# suite on their 2.11: bench/gpu_check.sh tests). FULL=1 runs everything everywhere.
PY ?= python3
FULL_VERSIONS := 2.15.0 2.9.1
VERSIONS := $(FULL_VERSIONS) 2.11.0 2.14.1 2.13.0
NEWEST := 2.15.0
FULL ?=
TEST_JOBS ?= 2
PYTEST_ARGS ?=
# A venv holds torch with its CUDA libraries (5-7 GB each, 30 GB for all five): DROP_VENVS=1 (CI) removes
# each version's venv once its tests ran, so no more than TEST_JOBS of them are on disk at a time.
DROP_VENVS ?=
DEPS := expecttest pytest pytest-xdist depyf tqdm numpy setuptools wheel transformers==5.17.0 import-linter

venv = .venv-torch$(1)
VENV := $(call venv,$(NEWEST))

.PHONY: test lint demo bench clean $(addprefix test-,$(VERSIONS))

test: lint
	$(MAKE) -k -j$(TEST_JOBS) --output-sync=target $(addprefix test-,$(VERSIONS))

# The layering (docs/ARCHITECTURE.md) and no import circles, as contracts in .importlinter.
lint: $(VENV)/.ready
	$(VENV)/bin/lint-imports

# One venv per torch version; the stamp file says it is complete. Some machines cap pip at an older
# torch through a constraints file (PIP_CONSTRAINT): the version is pinned here instead.
.PRECIOUS: .venv-torch%/.ready
.venv-torch%/.ready: setup.py pyproject.toml
	test -x $(call venv,$*)/bin/python || $(PY) -m venv $(call venv,$*)
	PIP_CONSTRAINT=/dev/null $(call venv,$*)/bin/pip install -q --no-cache-dir torch==$* $(DEPS)
	$(call venv,$*)/bin/pip install -q --no-build-isolation --no-deps -e .
	touch $@

# The venv is built inside the recipe, not as a prerequisite: make would build every version's venv
# while the first tests run (a free job slot), and DROP_VENVS could not bound the disk they take.
$(addprefix test-,$(VERSIONS)): test-%:
	$(MAKE) --no-print-directory $(call venv,$*)/.ready
	$(call venv,$*)/bin/python -m pytest -q $(if $(FULL)$(filter $*,$(FULL_VERSIONS)),,-m "not slow") \
	  $(PYTEST_ARGS); status=$$?; \
	$(if $(DROP_VENVS),rm -rf $(call venv,$*);) exit $$status

demo: $(VENV)/.ready
	$(VENV)/bin/python -m torch_ext demo

bench: $(VENV)/.ready
	$(VENV)/bin/python bench/trace_time.py
	$(VENV)/bin/python bench/compile_time.py

clean:
	rm -rf $(foreach v,$(VERSIONS),$(call venv,$(v))) *.egg-info
