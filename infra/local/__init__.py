"""Local server tooling that only the Makefile and the tests start: a whole cluster on 127.0.0.1 (cluster.py), its
PostgreSQL (postgres.py), and the Prefect and MLflow UI servers of `make ui` (ui.py). No pipeline code imports it."""
