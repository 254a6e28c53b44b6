"""The layers only look down: flows/ -> tasks/ -> infra/, and the pure rules import no engine."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

LAYERS = {"flows": 3, "tasks": 2, "infra": 1}
ENGINES = ("pyspark", "ray", "mlflow", "prefect", "deltalake", "delta", "torch", "petastorm", "pytorch_lightning")


def imported_modules(path: Path) -> set[str]:
    """The full module names every import in a file (function bodies included) names."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


def imported_packages(path: Path) -> set[str]:
    """The top-level names every import in a file (function bodies included) reaches."""
    return {name.split(".")[0] for name in imported_modules(path)}


def test_no_import_runs_up_a_layer() -> None:
    upward = []
    for layer, floor in LAYERS.items():
        for path in sorted((REPO / layer).rglob("*.py")):
            above = {name for name in imported_packages(path) if LAYERS.get(name, 0) > floor}
            upward += [f"{path.relative_to(REPO)} imports {name}" for name in sorted(above)]
    assert not upward, upward


def test_the_rules_and_the_results_import_no_engine() -> None:
    modules = sorted(
        f"imagelake.tasks.rules.{path.stem}"
        for path in (REPO / "tasks" / "rules").glob("*.py")
        if path.stem != "__init__"
    )
    modules.append("imagelake.tasks.results")
    code = (
        f"import importlib, json, sys; [importlib.import_module(m) for m in {modules!r}]; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    loaded = set(
        json.loads(
            subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
        )
    )
    assert len(modules) >= 9
    assert not {name.split(".")[0] for name in loaded} & set(ENGINES), sorted(
        name for name in loaded if name.split(".")[0] in ENGINES
    )


def test_the_stages_have_a_room_of_their_own_and_no_helper_or_stage_imports_a_stage() -> None:
    stages = sorted((REPO / "tasks" / "stages").glob("*.py"))
    declaring = [path for path in stages if "\n@stage(" in path.read_text()]
    assert len(declaring) >= 10, "the stage modules live in tasks/stages/"
    outside = [
        str(path.relative_to(REPO))
        for path in (REPO / "tasks").rglob("*.py")
        if "stages" not in path.parts and "\n@stage(" in path.read_text()
    ]
    assert not outside, f"stages outside tasks/stages/: {outside}"
    reaching = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in sorted((REPO / "tasks").rglob("*.py"))
        for name in sorted(imported_modules(path))
        if name.startswith("imagelake.tasks.stages.") and name.split(".")[2] != path.stem
    ]
    assert not reaching, reaching


def test_the_cached_split_files_have_one_owner_that_imports_no_petastorm_or_spark() -> None:
    code = "import json, sys, imagelake.tasks.data.cache_files; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    )
    assert not {name.split(".")[0] for name in loaded} & {"petastorm", "pyspark", "torch", "ray"}
    # Every reader of the layout reads it through that module: no import of the loader for it, and none inside a
    # function body to keep Petastorm out (the lazy imports it replaced).
    for name in ("cache.py", "train.py", "promote.py"):
        imports = imported_modules(REPO / "tasks" / "stages" / name)
        assert "imagelake.tasks.data.cache_files" in imports, name
        assert not {m for m in imports if m.startswith("imagelake.tasks.worker.loader")}, name


def test_the_local_server_tooling_has_a_room_no_pipeline_code_imports() -> None:
    assert {path.stem for path in (REPO / "infra" / "local").glob("*.py")} >= {"cluster", "postgres", "ui"}
    assert not [path.name for path in (REPO / "infra").glob("*.py") if path.stem in ("cluster", "postgres", "ui")]
    reaching = [
        f"{path.relative_to(REPO)} imports {name}"
        for layer in ("flows", "tasks", "infra")
        for path in sorted((REPO / layer).rglob("*.py"))
        if "local" not in path.parts
        for name in sorted(imported_modules(path))
        if name.startswith("imagelake.infra.local")
    ]
    assert not reaching, reaching
