# The two commands the README documents (each creates the environment it needs):
#   make demo   - create .venv and run the main job: a short Tree-LSTM training demo
#   make test   - create .venv (and .venv-xla: torch_xla on its CPU backend) and run lint, type
#                 checks, the docs build and the whole test suite, the XLA tests included
# and, while working:
#   make check  - the quick lane: lint, type checks and the unit tests but the slow and XLA ones
#   make test-integrations - the Lightning and accelerate recipes (docs/guide/lightning-accelerate.md)
#                 with the real packages, installed into .venv (the integrations extra)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.torchfold-installed
# torch_xla pins its own torch, so the XLA tests run in a second environment
XLA_VENV ?= .venv-xla
XLA_STAMP := $(XLA_VENV)/.torchfold-installed
# DyNet (PyPI dynet38) only for the Tree-LSTM benchmark and its smoke test, never a dependency
DYNET_VENV ?= .venv-dynet
DYNET_STAMP := $(DYNET_VENV)/.torchfold-installed
DEMO_ARGS ?=

# $(call timed,LANE,COMMAND): run COMMAND (shown), then say how long LANE took, passed or not, so that
# a CI log shows where its time goes (COMMAND must not contain a comma)
timed = echo '$(2)'; start=$$(date +%s); $(2); status=$$?; \
	echo "[lane time] $(1): $$(( $$(date +%s) - start )) s (exit $$status)"; exit $$status

.PHONY: demo test check lint typecheck docs unit quick test-xla test-integrations env env-xla env-dynet envs clean

env: $(STAMP)

# (the install builds the C part of recording and planning in place: a change of its source installs again)
$(STAMP): setup.py pyproject.toml torchfold/engine/_record.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,notebooks,plot,docs]'
	touch $@

env-xla: $(XLA_STAMP)

$(XLA_STAMP): setup.py pyproject.toml torchfold/engine/_record.c
	test -x $(XLA_VENV)/bin/python || $(PYTHON) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install --quiet --upgrade pip
	# (--no-cache-dir: these wheels, CUDA libraries included, come from the index, several GB that
	# pip would otherwise also keep in its cache)
	$(XLA_VENV)/bin/python -m pip install --quiet --no-cache-dir torch==2.9.0 torchvision==0.24.0 torch_xla==2.9.0 mlxtend
	$(XLA_VENV)/bin/python -m pip install --quiet -e '.[dev,xla]'
	touch $@

env-dynet: $(DYNET_STAMP)

$(DYNET_STAMP):
	test -x $(DYNET_VENV)/bin/python || $(PYTHON) -m venv $(DYNET_VENV)
	$(DYNET_VENV)/bin/python -m pip install --quiet dynet38
	touch $@

demo: env
	$(BIN)/python -m torchfold demo $(DEMO_ARGS)

lint: env
	@$(call timed,lint,$(BIN)/ruff check torchfold tests benchmarks scripts docs/_hooks && \
		$(BIN)/ruff format --check torchfold tests benchmarks scripts docs/_hooks)

typecheck: env
	@$(call timed,typecheck,$(BIN)/mypy)

# the site goes under build/ (git-ignored); --strict turns every warning (a broken link, a
# docstring reference that does not resolve) into a failure
docs: env
	@$(call timed,docs,NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet)

# (the integrations lane runs apart: test-integrations)
unit: env env-dynet
	@$(call timed,unit,$(BIN)/python -m pytest -m "not xla and not integrations")

# the unit tests without the slow (processes, notebooks, clean venvs) and the XLA ones
quick: env
	$(BIN)/python -m pytest -q -m "not slow and not xla"

# each file in a process of its own: torch_xla has crashed in a process that had run many
# programs before (one file's state never reaches another's tests)
XLA_TESTS = tests/train/test_xla.py tests/train/capture/test_xla_runner.py \
	tests/train/capture/test_capture_regressions.py tests/engine/static/test_xla_seed_loop.py \
	tests/train/capture/test_xla_user_loop.py tests/cli/test_train_task_xla.py \
	tests/train/capture/test_replay_trust.py tests/train/capture/test_sound_steps.py \
	tests/train/test_persample_xla.py tests/train/capture/test_dynamo_programs.py

test-xla: env-xla
	@lane=$$(date +%s); status=0; for f in $(XLA_TESTS); do \
		echo "PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -m xla $$f"; start=$$(date +%s); \
		PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -m xla $$f || status=1; \
		echo "[lane time] xla $$f: $$(( $$(date +%s) - start )) s"; \
	done; echo "[lane time] xla: $$(( $$(date +%s) - lane )) s (exit $$status)"; exit $$status

# Lightning and accelerate, installed into .venv once (the integrations extra: under 15 s of pip
# here); TORCHFOLD_INTEGRATIONS=require: a package that is missing fails the tests, never skips them
INTEGRATIONS_STAMP := $(VENV)/.integrations-installed

$(INTEGRATIONS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[integrations]'
	touch $@

test-integrations: $(INTEGRATIONS_STAMP)
	@$(call timed,integrations,TORCHFOLD_INTEGRATIONS=require $(BIN)/python -m pytest -m integrations tests/integrations)

# the environments at once, before the lanes: their downloads and installs overlap (on a 2-core
# machine, 95 s from nothing against 223 s one after the other); the integrations extra goes into
# .venv here, before any lane imports from it
envs:
	@$(call timed,environments,$(MAKE) --no-print-directory -j3 env env-xla env-dynet $(INTEGRATIONS_STAMP))

# the lanes two at a time once the environments are there, the two long ones first (the unit and
# the XLA lanes, each mostly one busy thread, overlap); each lane's output is printed whole when
# it ends; -k: a failing lane does not keep the others from running and reporting
test: envs
	@$(call timed,lanes,$(MAKE) --no-print-directory -k -j2 --output-sync=target unit test-xla lint typecheck docs test-integrations)

check: lint typecheck quick

clean:
	rm -rf $(VENV) $(XLA_VENV) $(DYNET_VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache
