# `make test` runs the suite on every supported torch version, each in its own venv: one version after
# another, each with WORKERS pytest workers (pytest-xdist; both cores of a 2-core machine), while the next
# version's venv installs beside it (PREFETCH; its log is shown if the install fails). The newest tested
# torch is the default venv (demo, bench). Tests marked `slow` (fresh processes, Inductor compiles: ~60% of
# a version's time on a 2-core machine) run on FULL_VERSIONS (the newest and the oldest, whose code paths
# differ most); the versions between run the rest, which keeps CI well inside its time limit (the GPU
# machines run the whole suite on their 2.11: bench/gpu_check.sh tests). FULL=1 runs everything everywhere.
PY ?= python3
FULL_VERSIONS := 2.15.0 2.9.1
VERSIONS := $(FULL_VERSIONS) 2.11.0 2.14.1 2.13.0
NEWEST := 2.15.0
FULL ?=
WORKERS ?= 2
PREFETCH ?= 1
PYTEST_ARGS ?=
# A venv holds torch with its CUDA libraries (5-7 GB each, 30 GB for all five): DROP_VENVS=1 (CI) removes
# each version's venv once its tests ran, so no more than two are on disk at a time (one with PREFETCH=0).
DROP_VENVS ?=
DEPS := expecttest pytest pytest-xdist depyf tqdm numpy setuptools wheel transformers==5.17.0 import-linter

venv = .venv-torch$(1)
VENV := $(call venv,$(NEWEST))

.PHONY: test lint demo bench clean $(addprefix test-,$(VERSIONS))

# Every version runs even when one fails; the exit status says whether all passed. Why one at a time with
# two workers and not two versions at once: two single-process suites and their installs oversubscribed
# the two cores (CI 50 min, 2026-11-27); this way an install waits on the network while tests compute.
test: lint
	@set -- $(VERSIONS); failed=""; \
	while [ $$# -gt 0 ]; do \
	  v=$$1; shift; next=$${1:-}; pid=""; \
	  if [ -n "$$next" ] && [ "$(PREFETCH)" = 1 ]; then \
	    $(MAKE) --no-print-directory $(call venv,$$next)/.ready >.venv-install-$$next.log 2>&1 & pid=$$!; fi; \
	  $(MAKE) --no-print-directory test-$$v || failed="$$failed $$v"; \
	  if [ -n "$$pid" ] && ! wait $$pid; then cat .venv-install-$$next.log; fi; \
	  rm -f .venv-install-$$next.log; \
	done; \
	if [ -n "$$failed" ]; then echo "make test: failed on torch$$failed"; exit 1; fi; \
	echo "make test: passed on torch $(VERSIONS)"

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

# The venv is built inside the recipe (a no-op where `test` installed it ahead), not as a prerequisite:
# `make test-2.13.0` alone builds its own.
$(addprefix test-,$(VERSIONS)): test-%:
	$(MAKE) --no-print-directory $(call venv,$*)/.ready
	$(call venv,$*)/bin/python -m pytest -q $(if $(FULL)$(filter $*,$(FULL_VERSIONS)),,-m "not slow") \
	  $(if $(filter-out 0 1,$(WORKERS)),-n $(WORKERS)) $(PYTEST_ARGS); status=$$?; \
	$(if $(DROP_VENVS),rm -rf $(call venv,$*);) exit $$status

demo: $(VENV)/.ready
	$(VENV)/bin/python -m torch_ext demo

bench: $(VENV)/.ready
	$(VENV)/bin/python bench/dev/trace_time.py
	$(VENV)/bin/python bench/compile_time.py

clean:
	rm -rf $(foreach v,$(VERSIONS),$(call venv,$(v))) *.egg-info
