# Front door. `make help` lists the targets. Pins come from versions.env (the one source of truth).
include versions.env

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

VENV := .venv
PY := $(VENV)/bin/python
CLI := $(VENV)/bin/ternary-serve
COMPOSE := docker compose

# Settings (make config NAME=value; `make settings` lists them): declared once, with their defaults
# and checks, in ternary_serve/settings.py, and kept in settings.env by `ternary-serve config`.
SETTING_NAMES := $(shell python3 -m ternary_serve.settings --names)
# Make's own variables, for single targets:
# deploy/rollback: an image tag (make releases lists them); empty = the configured / previous one.
TAG ?=
# make model: a models.yaml name (MODEL=) or a source (SOURCE=https://…, hf://OWNER/REPO/FILE, a
# path, a Hugging Face checkpoint directory), and optionally the expected SHA-256.
MODEL ?=
SOURCE ?=
SHA256 ?=
# make convert: SRC= a checkpoint directory or a GGUF; TYPE= the target type; EMBEDDINGS_TYPE= the
# type for token_embd/output (empty: llama-quantize's choice).
SRC ?=
TYPE ?= Q2_0
EMBEDDINGS_TYPE ?=
# One image for the three base-image settings, e.g. a local stand-in where no registry is reachable.
BASE_IMAGE_OVERRIDE ?=
# make bench: where its JSON and PNG go.
BENCH_OUT ?= $(CURDIR)/bench
# make fleet-*: the Ansible inventory of the serving hosts and the gateway (ansible/inventory by
# default; ansible/inventory.fleet.example shows three 4090 boxes), and hosts per batch after the
# canary.
INVENTORY ?= $(CURDIR)/ansible/inventory
BATCH ?= 1
MAKE_ONLY := TAG MODEL SOURCE SHA256 SRC TYPE EMBEDDINGS_TYPE BASE_IMAGE_OVERRIDE BENCH_OUT INVENTORY \
	BATCH
# The stand-in that tests/bootstrap.py builds on machines without registry access.
STAND_IN_IMAGE := local/debian:bookworm-test

# A misspelt setting on the command line is an error, not a silently ignored variable.
$(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(if \
	$(filter $(v),$(SETTING_NAMES) $(MAKE_ONLY)),,$(error $(v) is neither a setting nor a Make \
	variable: `make settings` lists the settings))))
# A setting's value as configured (.env), in a recipe.
setting = "$$($(CLI) settings --get $(1))"
# The settings given on this command line, for ternary-serve config.
SETTING_ARGS := $(foreach v,$(SETTING_NAMES),$(if $(filter command line,$(origin $(v))),'$(v)=$($(v))')) \
	$(if $(MODEL)$(SOURCE),'MODEL_SOURCE=$(or $(MODEL),$(SOURCE))') $(if $(SHA256),'MODEL_SHA256=$(SHA256)') \
	$(if $(BASE_IMAGE_OVERRIDE),$(foreach role,BUILD RUNTIME GATEWAY,'$(role)_BASE_IMAGE=$(BASE_IMAGE_OVERRIDE)'))

.PHONY: help venv versions config settings plan model convert build release up deploy rollback releases images-bundle \
	rotate-key down bench smoke logs demo test check docs-figures docs-settings lint bootstrap constraints fleet-deploy fleet-rollback \
	fleet-releases

help: ## list targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	python3 tests/bootstrap.py engine-source
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q vendor/llama.cpp/gguf-py -e '.[dev,bench]'
	touch $@

venv: $(VENV)/.installed ## Python environment with the package and dev tools

versions: ## the pins this checkout builds with (versions.env)
	@echo "project  $(PROJECT_VERSION)"
	@echo "engine   $(ENGINE_REPO) @ $(ENGINE_REF) (commit $(ENGINE_COMMIT))"
	@echo "offline  $(MAINLINE_ENGINE_REPO) @ $(OFFLINE_ENGINE_REF) (commit $(OFFLINE_ENGINE_COMMIT))"
	@echo "cuda     $(CUDA_VERSION), architectures $(CUDA_ARCHITECTURES), gcc $(GCC_VERSION)"
	@echo "images   $(CUDA_BUILD_IMAGE) -> $(CUDA_RUNTIME_IMAGE); cpu: $(CPU_RUNTIME_IMAGE)"

# Every distribution the smoke and convert images install from PyPI, pinned once for both (their
# Dockerfile stages install under PIP_CONSTRAINT=docker/constraints.txt): the converter's
# requirements through the convert stage's own filter (docker/convert_requirements.py), torch at
# TORCH_VERSION, the build backends of the two local packages (pip's build isolation honours
# PIP_CONSTRAINT too), the engine's gguf-py
# and the project (local: not pinned, their dependencies are). --universal from Python 3.10
# (the CUDA runtime's Ubuntu 22.04) up: a pin that differs by Python carries a marker. Pins
# already in the file are kept where they still fit; delete it first to move all to the latest.
constraints: venv ## re-pin docker/constraints.txt: all the smoke and convert images install from PyPI
	python3 tests/bootstrap.py wheels
	{ python3 docker/convert_requirements.py vendor/llama.cpp/requirements; \
	  printf '%s\n' 'torch==$(TORCH_VERSION)' setuptools poetry-core ./vendor/llama.cpp/gguf-py .; } \
	| $(VENV)/bin/uv pip compile - --quiet --universal --python-version 3.10 --no-python-downloads \
		--find-links docker/wheels $(if $(wildcard docker/wheels/torch-*.whl),,--extra-index-url \
		$(TORCH_INDEX_URL) --index-strategy unsafe-best-match) --no-emit-package gguf \
		--no-emit-package ternary-serve --annotation-style line \
		--custom-compile-command 'make constraints' --output-file docker/constraints.txt

config: venv ## settings NAME=value (kept in settings.env); writes .env and the server flags with the plan
	$(CLI) config $(SETTING_ARGS)

settings: venv ## list the settings: current value, default, meaning
	$(CLI) settings

plan: config ## the memory plan for the configured model: slots x context x KV cache type
	$(CLI) plan $(call setting,MODEL_DIR)/$(call setting,MODEL_FILE)

model: config ## fetch MODEL=<name in models.yaml> or SOURCE=... into MODEL_DIR/MODEL_FILE, verified
	@test -n "$(MODEL)$(SOURCE)" || { echo "make model: set MODEL=<name in models.yaml>, or \
		SOURCE=https://…, hf://OWNER/REPO/FILE, a file or a checkpoint directory"; exit 2; }
	$(if $(and $(SOURCE),$(wildcard $(SOURCE)/config.json)),\
		$(MAKE) --no-print-directory convert SRC=$(SOURCE),\
		$(CLI) fetch "$(or $(MODEL),$(SOURCE))" $(call setting,MODEL_DIR)/$(call setting,MODEL_FILE) \
			--backend $(call setting,BACKEND) $(if $(SHA256),--sha256 $(SHA256)))

convert: build ## SRC=<checkpoint dir or GGUF> -> TYPE (Q2_0) at MODEL_DIR/MODEL_FILE, engine's tools
	@test -n "$(SRC)" || { echo "make convert: set SRC=<Hugging Face checkpoint directory or GGUF>"; \
		exit 2; }
	$(COMPOSE) run --rm --no-deps -v "$(abspath $(SRC)):/input/$(notdir $(abspath $(SRC))):ro" \
		model-init convert "/input/$(notdir $(abspath $(SRC)))" /models/$(call setting,MODEL_FILE) \
		--type $(TYPE) --backend $(call setting,BACKEND) $(if $(EMBEDDINGS_TYPE),--embeddings-type $(EMBEDDINGS_TYPE))

build: config ## build the release's images: server, model-init, smoke, gateway (tags: version, engine, backend)
	$(COMPOSE) --profile gateway build
	@# A rebuild under the same tag leaves the old image untagged: remove this project's.
	docker image prune -f --filter label=com.docker.compose.project=$(call setting,PROJECT_NAME) >/dev/null

release: build ## build and tag a release (the tag is printed; make releases lists deployed ones)
	@grep '^IMAGE_TAG=' .env

images-bundle: build ## the release's four images in one archive (build/), for llm_stack_images_bundle
	$(CLI) release bundle

up: build ## build, fetch MODEL/SOURCE if given, deploy: live only if healthy and smoke passes
	$(if $(MODEL)$(SOURCE),$(MAKE) --no-print-directory model)
	$(CLI) release deploy

deploy: venv ## deploy TAG=...: on failed health or smoke, the previous good release comes back
	$(CLI) release deploy $(TAG)

rollback: venv ## back to the previous good release, or to TAG=...
	$(CLI) release rollback $(TAG)

releases: venv ## the release history: tag, when, model manifest, smoke result, live marker
	$(CLI) release list

# A fleet (ansible/deploy.yml, rollback.yml, releases.yml; run from ansible/ for its ansible.cfg).
PLAYBOOK = cd ansible && $(CURDIR)/$(VENV)/bin/ansible-playbook -i $(INVENTORY)
fleet-deploy: images-bundle ## roll this checkout's release across INVENTORY: canary host first, then BATCH at a time
	$(PLAYBOOK) deploy.yml -e release_tag="$$(grep '^IMAGE_TAG=' .env | cut -d= -f2)" -e rollout_batch=$(BATCH)

fleet-rollback: venv ## the fleet back to TAG=... (or each replica's previous good release), canary first
	$(PLAYBOOK) rollback.yml $(if $(TAG),-e release_tag=$(TAG)) -e rollout_batch=$(BATCH)

fleet-releases: venv ## which release every replica of INVENTORY's serving hosts runs
	$(PLAYBOOK) releases.yml

rotate-key: venv ## a new API key for the live release (restarted, smoke tested; else the old key stays)
	$(CLI) release rotate-key

bench: venv ## llama-bench, llama-batched-bench and a client sweep of the live release -> BENCH_OUT
	$(CLI) bench --out $(BENCH_OUT)

smoke: ## smoke test the running stack again
	$(COMPOSE) run --rm smoke

logs: ## follow the server's logs
	$(COMPOSE) logs -f llama-server

down: ## stop the stack (models and images stay)
	$(COMPOSE) down

bootstrap: ## install and start Docker, Compose, buildx; build the base stand-in; fetch engine source
	python3 tests/bootstrap.py all

demo: venv ## no GPU, no registry: serve a synthetic tiny ternary model on the CPU stack
	python3 tests/bootstrap.py docker base-images engine-source wheels
	$(CLI) synth $(CURDIR)/models/tiny-ternary.gguf --profile tiny
	$(MAKE) up BACKEND=cpu ENGINE_SOURCE=local MODEL_DIR=$(CURDIR)/models MODEL_FILE=tiny-ternary.gguf \
		BASE_IMAGE_OVERRIDE=$(STAND_IN_IMAGE)

lint: venv ## ruff, yamllint, hadolint, ansible-lint (production profile), playbook syntax
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/yamllint -s .
	$(VENV)/bin/hadolint docker/Dockerfile
	$(VENV)/bin/ansible-lint -q --profile production ansible/
	for playbook in $(filter-out ansible/requirements.yml,$(wildcard ansible/*.yml)); do \
		$(VENV)/bin/ansible-playbook -i ansible/inventory.example --syntax-check "$$playbook"; done

test: bootstrap venv ## everything CI runs, in lanes side by side: lint, unit tests, the stacks in Docker
	$(PY) tests/lanes.py

check: venv lint ## the inner loop: lint and every test that needs no Docker (a few minutes)
	python3 tests/bootstrap.py compose
	$(PY) -m pytest -m "not docker" -q -p no:cacheprovider --durations=5

docs-settings: ## regenerate docs/settings.md from the settings registry (a test fails when it is stale)
	python3 -m ternary_serve.settings --page > docs/settings.md.tmp && mv docs/settings.md.tmp docs/settings.md

docs-figures: venv ## copy the figures of the last green `make test` (test-results/docs) into docs/
	$(PY) tests/lanes.py publish
