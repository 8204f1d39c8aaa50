VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: quickstart test test-slow test-all lint clean

$(PY):
	python3 -m venv $(VENV)

# Reinstall only when the package's declared dependencies change.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,ray,lora]' -c constraints.txt
	touch $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/assay quickstart

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

# the end-to-end tests that take minutes (local Ray clusters, node loss); CI runs them after `make test`
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow tests

test-all: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) runs
