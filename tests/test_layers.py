"""The layers only look down: flows/ -> tasks/ -> infra/, and the pure rules import no engine."""

from __future__ import annotations

import ast
import json
import shutil
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
    """The top-level names every import in a file (function bodies included) reaches; imagelake's own by their layer
    (imagelake.tasks.rules.images -> tasks)."""
    return {
        name.split(".")[1] if name.startswith("imagelake.") else name.split(".")[0] for name in imported_modules(path)
    }


def test_no_import_runs_up_a_layer() -> None:
    assert "tasks" in imported_packages(REPO / "flows" / "pipeline.py"), "imagelake's imports are read by their layer"
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
        if name.startswith("imagelake.tasks.stages.") and name.split(".")[3] != path.stem
    ]
    assert not reaching, reaching


def test_no_two_modules_share_a_name_but_a_flow_and_the_stage_it_runs() -> None:
    """A module's name says which one it is: two rooms never hold modules of one name (tasks/data/listing.py and a
    tasks/rules/listing.py), except a flow of flows/ and the stage of tasks/stages/ it runs (flows/score.py)."""
    from collections import defaultdict

    rooms = defaultdict(list)
    for part in ("flows", "tasks", "infra"):
        for path in (REPO / part).rglob("*.py"):
            if path.name != "__init__.py":
                rooms[path.name].append(str(path.parent.relative_to(REPO)))
    shared = {name: sorted(where) for name, where in rooms.items() if len(where) > 1}
    assert {name: where for name, where in shared.items() if where != ["flows", "tasks/stages"]} == {}


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


def test_imagelake_is_the_one_name_installed_and_every_package_folder_goes_with_it(tmp_path: Path) -> None:
    """flows/, tasks/ and infra/ install as imagelake.flows, imagelake.tasks and imagelake.infra: a wheel built from the
    repository holds `imagelake` alone at its top, with every folder that has an __init__.py, and this environment
    imports nothing as `tasks`, `flows` or `infra` (another project's packages of those names stay theirs)."""
    import tomllib
    import zipfile

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        ".".join(("imagelake", *init.parent.relative_to(REPO).parts))
        for layer in LAYERS
        for init in (REPO / layer).rglob("__init__.py")
    }
    assert listed == folders, f"pyproject.toml's packages leave out {sorted(folders - listed)}"

    source = tmp_path / "source"
    for name in ("pyproject.toml", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((REPO / name).read_bytes())
    for layer in LAYERS:
        shutil.copytree(REPO / layer, source / layer, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("imagelake-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {"imagelake"}
    assert "imagelake/tasks/inference/served_pyfunc.py" in names and "imagelake/__init__.py" not in names

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        "import importlib.util, json; "
        "print(json.dumps({n: importlib.util.find_spec(n) is not None "
        "for n in ('tasks', 'flows', 'infra', 'imagelake.tasks', 'imagelake.flows.cli')}))"
    )
    found = json.loads(
        subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True, check=True).stdout
    )
    assert found == {
        "tasks": False,
        "flows": False,
        "infra": False,
        "imagelake.tasks": True,
        "imagelake.flows.cli": True,
    }


def test_no_module_of_imagelake_reaches_itself_again_through_its_imports() -> None:
    """No circle: no module reaches itself through the imports of the modules it imports (imports in functions
    included)."""
    from imagelake.tasks import code_graph

    folders = code_graph.code_folders()
    circles = []
    for layer in LAYERS:
        for path in sorted((REPO / layer).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            module = ".".join(("imagelake", *(part for part in parts if part != "__init__")))
            imported = {name for name in code_graph.imports_of(module, path) if name != module}
            back = [
                name
                for name in imported
                # A package is reached as the enclosing package of its own modules: that is no import of it.
                if code_graph.module_file(name, folders)
                and not name.startswith(f"{module}.")
                and module in code_graph.reached(name, folders)
            ]
            circles += [f"{module} -> {name} -> ... -> {module}" for name in sorted(back)]
    assert not circles, circles


# What a flow-run process must not load before a stage needs it: seconds of start-up each (torch and Lightning most).
LOADED_BY_STAGES = (
    "torch",
    "torchvision",
    "pytorch_lightning",
    "lightning",
    "torchmetrics",
    "matplotlib",
    "ray",
    "mlflow",
    "pandas",
)


def test_the_flow_modules_deployments_import_load_no_model_library_before_a_stage_needs_it() -> None:
    """Every flow module prefect.yaml's deployments name, imported in a fresh interpreter as a flow run imports it:
    torch, Lightning, torchvision, matplotlib, Ray, MLflow and pandas stay unloaded (the stages that use them import
    them). So they do after the weights check every training run makes before its first stage, for the default weights
    (known by digest, in the cache after `make install`) and from scratch."""
    import yaml

    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    modules = sorted(
        {"imagelake." + d["entrypoint"].split(":")[0].removesuffix(".py").replace("/", ".") for d in deployments}
    )
    assert "imagelake.flows.pipeline" in modules
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "from imagelake.flows.flow import check_weights\n"
        "from imagelake.infra.settings import load_settings\n"
        "for weights in ('IMAGENET1K_V1', 'MobileNet_V2_Weights.IMAGENET1K_V1', 'none'):\n"
        "    check_weights(load_settings(overrides={'model_arch': 'mobilenet_v2', 'pretrained': weights}))\n"
        f"print(json.dumps(sorted(m for m in {list(LOADED_BY_STAGES)!r} if m in sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], f"loaded on import of {modules}"


def test_the_registry_commands_load_no_torch_and_name_the_served_model_as_it_is() -> None:
    """`imagelake history`, `lineage`, `promote` and `rollback` import the registry's modules of lineage, alias moves
    and loading only: in a fresh interpreter they load neither torch nor the served model, whose file and artifact
    keys the loading module names as the served model does."""
    script = (
        "import json, sys\n"
        "import imagelake.tasks.registry.lineage, imagelake.tasks.registry.moves\n"
        "import imagelake.tasks.registry.loading as models\n"
        "loaded = sorted(m for m in ('torch', 'torchvision', 'pytorch_lightning', "
        "'imagelake.tasks.inference.served_pyfunc') if m in sys.modules)\n"
        "from imagelake.tasks.inference import served_pyfunc\n"
        "same = [models.PROGRAM, models.META, str(models.SERVED_MODEL)] == "
        "[served_pyfunc.PROGRAM, served_pyfunc.META, served_pyfunc.__file__]\n"
        "print(json.dumps({'loaded': loaded, 'same': same}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"loaded": [], "same": True}


def environment_reads(path: Path) -> list[str]:
    """The names of the environment variables a module reads (os.environ[...], .get, `in os.environ`, os.getenv),
    each resolved through the module's string constants when it is given by name."""
    tree = ast.parse(path.read_text())
    constants = {
        target.id: node.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }

    def is_environ(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "environ"
            or (isinstance(node, ast.Name) and node.id == "environ")
        )

    def text(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        if isinstance(node, ast.JoinedStr) and node.values:
            return text(node.values[0])
        return None

    read = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args:
            function = node.func
            if isinstance(function, ast.Attribute) and function.attr in ("get", "pop") and is_environ(function.value):
                key = node.args[0]
            elif (
                isinstance(function, ast.Attribute | ast.Name)
                and getattr(function, "attr", getattr(function, "id", "")) == "getenv"
            ):
                key = node.args[0]
        elif isinstance(node, ast.Compare) and any(is_environ(side) for side in node.comparators):
            key = node.left
        name = text(key) if key is not None else None
        if name:
            read.append(name)
    return read


def test_no_pipeline_module_reads_an_imagelake_variable_but_through_settings() -> None:
    # An IMAGELAKE_* variable read apart from Settings is a setting no one can see: not in docs/settings.md, not in a
    # settings file, not under the run policy. infra/local/ is the Makefile's and the tests' tooling, not the pipeline.
    assert environment_reads_of_text(
        'import os\nNAME = "IMAGELAKE_X"\nos.environ.get(NAME) or os.getenv("IMAGELAKE_Y")'
    ) == [
        "IMAGELAKE_X",
        "IMAGELAKE_Y",
    ]
    found = {
        str(path.relative_to(REPO)): names
        for layer in LAYERS
        for path in sorted((REPO / layer).rglob("*.py"))
        if "local" not in path.relative_to(REPO).parts
        and (names := [name for name in environment_reads(path) if name.startswith("IMAGELAKE_")])
    }
    assert not found, f"read these through a setting of infra/settings.py instead: {found}"


def environment_reads_of_text(source: str) -> list[str]:
    """environment_reads of a module's source text (for the test's own check that it sees a read)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "module.py"
        path.write_text(source)
        return environment_reads(path)


def test_every_thread_a_run_starts_sees_the_context_of_the_code_starting_it() -> None:
    # A bare threading.Thread starts without the starter's context variables, Prefect's settings among them: what it
    # logs or asks of Prefect goes to no API, and Prefect starts a server of its own (infra/threads.py). The training
    # workers' loader threads (tasks/worker/) run outside any Prefect run.
    bare = [
        f"{path.relative_to(REPO)}:{number}"
        for layer in LAYERS
        for path in sorted((REPO / layer).rglob("*.py"))
        if path.relative_to(REPO).parts[:2] not in (("tasks", "worker"), ("infra", "local"))
        and path != REPO / "infra" / "threads.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "threading.Thread(" in line
    ]
    assert not bare, f"start these through infra/threads.py:context_thread: {bare}"
