# `make test` runs the whole suite on every supported torch version, each in its own venv.
# The newest tested torch is the default venv (demo, bench).
PY ?= python3
VERSIONS := 2.14.1 2.13.0 2.9.1
NEWEST := 2.14.1
PYTEST_ARGS ?=
DEPS := expecttest pytest depyf tqdm numpy setuptools wheel transformers==5.17.0

venv = .venv-torch$(1)
VENV := $(call venv,$(NEWEST))

.PHONY: test demo bench clean $(addprefix test-,$(VERSIONS))

test: $(addprefix test-,$(VERSIONS))

# One venv per torch version; the stamp file says it is complete.
.PRECIOUS: .venv-torch%/.ready
.venv-torch%/.ready: setup.py pyproject.toml
	test -x $(call venv,$*)/bin/python || $(PY) -m venv $(call venv,$*)
	$(call venv,$*)/bin/pip install -q torch==$* $(DEPS)
	$(call venv,$*)/bin/pip install -q --no-build-isolation --no-deps -e .
	touch $@

$(addprefix test-,$(VERSIONS)): test-%: .venv-torch%/.ready
	$(call venv,$*)/bin/python -m pytest -q $(PYTEST_ARGS)

demo: $(VENV)/.ready
	$(VENV)/bin/python -m torch_ext demo

bench: $(VENV)/.ready
	$(VENV)/bin/python bench/trace_time.py
	$(VENV)/bin/python bench/compile_time.py

clean:
	rm -rf $(foreach v,$(VERSIONS),$(call venv,$(v))) *.egg-info
