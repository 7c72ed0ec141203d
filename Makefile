# `make test` runs the whole suite on both supported torch versions, each in its own venv.
PY ?= python3
VENV := .venv
VENV29 := .venv-torch2.9
PYTEST_ARGS ?=
DEPS := expecttest pytest depyf tqdm numpy setuptools wheel

.PHONY: test test-213 test-29 demo bench clean

test: test-213 test-29

$(VENV)/.ready: setup.py pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0 $(DEPS)
	$(VENV)/bin/pip install -q --no-build-isolation --no-deps -e .
	touch $@

$(VENV29)/.ready: setup.py pyproject.toml
	test -x $(VENV29)/bin/python || $(PY) -m venv $(VENV29)
	$(VENV29)/bin/pip install -q torch==2.9.1 $(DEPS)
	$(VENV29)/bin/pip install -q --no-build-isolation --no-deps -e .
	touch $@

test-213: $(VENV)/.ready
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

test-29: $(VENV29)/.ready
	$(VENV29)/bin/pytest -q $(PYTEST_ARGS)

demo: $(VENV)/.ready
	$(VENV)/bin/python -m torch_ext demo

bench: $(VENV)/.ready
	$(VENV)/bin/python bench/trace_time.py
	$(VENV)/bin/python bench/compile_time.py

clean:
	rm -rf $(VENV) $(VENV29) *.egg-info
