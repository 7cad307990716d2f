# Two entry points: `make demo` (train a tiny model against a local ORS environment)
# and `make test` (the full suite). Each creates its own virtual environment; `make docs` builds the site in it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

.PHONY: demo test docs lint bench clean venv browser

# torch first, pinned (TORCH_INDEX=https://download.pytorch.org/whl/cpu: PyTorch's CPU build, where pip's default is
# the CUDA one); then everything else under the pinned constraints.
$(STAMP): pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -c requirements/constraints.txt -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ors-trl demo $(ARGS)

# JOBS test processes (pytest-xdist; whole files per process, so a module's servers start once); JOBS=0: one process.
JOBS ?= 2
test: $(STAMP) browser
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile $(ARGS)

# The report's tests open the page in headless Chromium (Debian's package); installed here, never by a test.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && apt-get install -y -qq -o DPkg::Lock::Timeout=120 chromium >/dev/null; } || \
		echo "chromium is not installed (needs root and apt-get): the headless-browser tests will be skipped"

# The documentation site into site/ (mkdocs.yml), warnings as errors; the `docs` extra is part of `dev`.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples

bench: $(STAMP)
	$(PY) benchmarks/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist site src/*.egg-info
