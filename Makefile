# temper — set up a venv and run the main job or the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-threads lint bench clean gpu-wheels sandbox-deps docker-deps browser-deps postgres-deps ui docs docs-serve

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: 2.13.0 is the CPU wheel on local disk; an unpinned torch pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# Agent actions and generated verifiers run inside bubblewrap: install it (as root) or say how.
sandbox-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing bubblewrap"; apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; \
	  else echo "bubblewrap is required: sudo apt-get install bubblewrap" >&2; exit 1; fi; }

# The Docker sandbox and Pipes-in-containers need a Docker engine: install docker.io and start dockerd (as root,
# vfs storage, no bridge: containers run with --network none) when none answers.
docker-deps:
	@command -v dockerd >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing docker.io"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null; \
	  else echo "docker is required: sudo apt-get install docker.io" >&2; exit 1; fi; }
	@docker info >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "starting dockerd"; mkdir -p runs; \
	    nohup dockerd --storage-driver=vfs --iptables=false --bridge=none >runs/dockerd.log 2>&1 & \
	    for i in $$(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done; \
	    docker info >/dev/null 2>&1 || { echo "dockerd did not start: see runs/dockerd.log" >&2; exit 1; }; \
	  else echo "no Docker engine answers: start dockerd (sudo dockerd --storage-driver=vfs ...)" >&2; exit 1; fi; }

# The browser test drives Debian's chromium headless through Playwright.
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium"; apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium is required for the browser test: sudo apt-get install chromium" >&2; exit 1; fi; }

# The deployment test (tests/deploy) starts a throwaway PostgreSQL server from Debian's package (initdb + pg_ctl under
# /usr/lib/postgresql/*/bin, as the postgres user when run as root) and runs an iteration against it.
postgres-deps:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing postgresql"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	  else echo "postgresql is required for the deployment test: sudo apt-get install postgresql" >&2; exit 1; fi; }

# One post-training iteration on tiny as a Dagster run (the next iteration each time), then a summary whose links point
# where `make ui` serves (its DAGSTER_PORT and MLFLOW_PORT, below) and whose hint is the exact command to go on.
run: $(STAMP) sandbox-deps
	TEMPER_DAGSTER_UI=http://127.0.0.1:$(DAGSTER_PORT) TEMPER_MLFLOW_UI=http://127.0.0.1:$(MLFLOW_PORT) \
	  $(BIN)/temper run --preset tiny

# Two xdist workers, a file each at a time (module fixtures stay in one process), in collection order: tests/conftest.py
# puts the files with `slow` tests first. Each worker's torch takes one thread.
TEST_WORKERS ?= 2
test: $(STAMP) sandbox-deps docker-deps browser-deps postgres-deps
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The tests that compare floating-point results across processes, thread counts or batch shapes (ranks against one
# process, batched against solo decoding, resumed against continued runs, kernels against twins), at 2 intra-op
# threads in one process; `make test` runs them at 1. A comparison whose outcome depends on the reduction order a
# thread count gives fails one of the two. CI runs both (.ci/run).
THREAD_TESTS := tests/trainers/test_ddp_torchrun.py tests/trainers/test_backends.py tests/trainers/test_sharded_adamw.py \
	tests/trainers/test_train_checkpoint.py tests/trainers/test_megatron.py tests/trainers/test_megatron_checkpoint.py \
	tests/trainers/test_disaggregated.py tests/model/test_decode.py tests/model/test_moe.py \
	tests/model/test_chunked_head.py tests/model/test_checkpointing.py tests/rollout/test_engine.py \
	tests/pipelines/test_stage_ranks.py tests/pipelines/test_ddp_zero_stages.py
test-threads: $(STAMP) sandbox-deps
	TEMPER_TEST_THREADS=2 $(BIN)/python -m pytest -q -p no:xdist $(THREAD_TESTS)

# Dagster and MLflow UIs on 127.0.0.1 (make ui DAGSTER_PORT=3100 MLFLOW_PORT=5100); Ctrl-C stops both.
DAGSTER_PORT ?= 3000
MLFLOW_PORT ?= 5000
ui: $(STAMP) sandbox-deps
	$(BIN)/python -m pipelines.ui --dagster-port $(DAGSTER_PORT) --mlflow-port $(MLFLOW_PORT)

# The documentation site (mkdocs.yml, docs/) into site/, strictly: a broken link or anchor, a page missing from the nav
# or a docstring the API reference cannot render fails it. docs-serve serves it with live reload on 127.0.0.1:8000.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/model_forward.py
	$(BIN)/python bench/dsa_decode.py
	$(BIN)/python bench/indexshare_prefill.py
	$(BIN)/python bench/envs_throughput.py
	$(BIN)/python bench/server_load.py

clean:
	rm -rf $(VENV) runs .pytest_cache site

# The cp312 wheels the GPU machines lack (pydantic and its dependencies, megatron-core), for bench/gpu_run.sh to carry
# there. Downloaded with this machine's own pip (no venv needed: a fresh checkout runs it as is).
gpu-wheels:
	mkdir -p .gpu-wheels && $(PY) -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .gpu-wheels \
	  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions
	# megatron-core at the version the CPU suite tests (bench/megatron_gpu.py); its other dependencies are there
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 -d .gpu-wheels megatron-core==0.16.1
	@du -sh .gpu-wheels
