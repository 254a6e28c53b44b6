"""The registered model as any MLflow client calls it: image files in, label names and probabilities out, through
MLflow's own loader and through `mlflow models serve`; and imagelake's own reading of it and of older versions."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from PIL import Image

from imagelake.infra.local.cluster import free_port
from imagelake.infra.settings import load_settings
from imagelake.tasks.inference.cli_serving import predict_files
from imagelake.tasks.registry.loading import served_model
from imagelake.tasks.rules.images import resize_image
from imagelake.tasks.rules.warm_start import labels_tag
from imagelake.tasks.worker.model import ImageModel

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serving")]  # one process: the module's store, model and server

NAME = "colours"
SIZE = 16
# Names a comma-joined tag would have broken: a comma, quotes, and characters outside ASCII.
LABELS = ["apples, red", 'leaves "green"', "myrtilles bleues \U0001fad0"]
COLOURS = [(220, 40, 30), (40, 190, 50), (30, 50, 220)]


def drawing(label: int, seed: int) -> np.ndarray:
    """A noisy picture of one colour, of a size and shape other than the model's (so decoding letterboxes it)."""
    rng = np.random.default_rng(seed)
    height, width = int(rng.integers(20, 48)), int(rng.integers(20, 48))
    noise = rng.integers(-30, 30, (height, width, 3))
    return np.clip(np.array(COLOURS[label]) + noise, 0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, kind: str) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=kind, **({"quality": 90} if kind == "JPEG" else {}))
    return out.getvalue()


def files() -> list[tuple[str, bytes, str]]:
    """(name, bytes, the right label) for a PNG and a JPEG of each colour."""
    return [
        (f"{label}-{kind.lower()}", encoded(drawing(label, 100 + label), kind), LABELS[label])
        for label in range(3)
        for kind in ("PNG", "JPEG")
    ]


def colour_model() -> torch.nn.Module:
    """A small CNN taught the three colours on their decoded pictures, in a second."""
    torch.manual_seed(0)
    images = np.stack([resize_image(encoded(drawing(i % 3, i), "PNG"), SIZE)[0] for i in range(60)])
    labels = torch.tensor([i % 3 for i in range(60)])
    model = ImageModel(3)
    optimiser = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(40):
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(images)), labels).backward()
        optimiser.step()
    return model.eval()


@pytest.fixture(scope="module")
def champion(tmp_path_factory: pytest.TempPathFactory):
    """A SQLite MLflow store holding the colour model registered as imagelake registers a model, with the champion
    alias, and a version 2 saved in the format of earlier releases (pytorch flavour, pt2, labels comma-joined)."""
    root = tmp_path_factory.mktemp("serving")
    store = f"sqlite:///{root / 'mlflow.db'}"
    before = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    mlflow.set_tracking_uri(store)
    mlflow.set_registry_uri(store)
    client = MlflowClient(store, store)
    experiment = client.create_experiment("serving", artifact_location=str(root / "artifacts"))
    model = colour_model()
    examples = np.stack([resize_image(encoded(drawing(i, i), "PNG"), SIZE)[0] for i in range(2)])
    with tempfile.TemporaryDirectory() as folder, mlflow.start_run(experiment_id=experiment):
        info = mlflow.pyfunc.log_model(
            name="model", **served_model(Path(folder), model, LABELS, SIZE, "letterbox", 10_000_000, examples)
        )
    tags = {"labels": labels_tag(LABELS), "image_size": str(SIZE), "resize_mode": "letterbox"}
    version = mlflow.register_model(info.model_uri, NAME, tags=tags).version
    client.set_registered_model_alias(NAME, "champion", version)
    with mlflow.start_run(experiment_id=experiment):
        old = mlflow.pytorch.log_model(
            model,
            name="model",
            input_example=examples,
            serialization_format="pt2",
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],  # not inferred in a process of its own
        )
    mlflow.register_model(old.model_uri, NAME, tags={**tags, "labels": "apples,leaves,blueberries"})
    yield store, root
    mlflow.set_tracking_uri(before[0])
    mlflow.set_registry_uri(before[1])


def test_mlflow_s_own_loader_takes_image_files_and_answers_label_names(champion) -> None:
    store, root = champion
    loaded = mlflow.pyfunc.load_model(f"models:/{NAME}@champion")
    import pandas as pd

    given = files()
    as_bytes = loaded.predict(pd.DataFrame({"image": [data for _, data, _ in given]}))
    assert list(as_bytes["label"]) == [label for _, _, label in given], (
        "PNG and JPEG of each colour: its name, commas, quotes and all"
    )
    for top, probability in zip(as_bytes["top_k"], as_bytes["probability"], strict=True):
        assert [entry["probability"] for entry in top] == sorted((entry["probability"] for entry in top), reverse=True)
        assert len(top) == 3 and top[0]["probability"] == probability and 1 / 3 < probability <= 1
        assert sorted(entry["label"] for entry in top) == sorted(LABELS)
    as_text = loaded.predict(
        pd.DataFrame({"image": [base64.b64encode(data).decode() for _, data, _ in given]}), params={"top_k": 1}
    )
    assert list(as_text["label"]) == list(as_bytes["label"]) and all(len(top) == 1 for top in as_text["top_k"])

    # A bad row is answered with its reason; the rows around it still get their labels.
    png = given[0][1]
    mixed = loaded.predict(pd.DataFrame({"image": [png, b"not an image", png[: len(png) // 2], given[5][1]]}))
    assert list(mixed["label"]) == [LABELS[0], None, None, LABELS[2]]
    assert mixed["error"][1].startswith("not_an_image") and mixed["error"][2].startswith(("truncated", "undecodable"))
    assert mixed["error"][0] is None and mixed["probability"][1] is None
    with pytest.raises(MlflowException, match="the request has no images"):
        loaded.predict(pd.DataFrame({"image": pd.Series([], dtype=object)}))

    # The model decodes with the rules saved with it, a package of their own. Loading it put the model's code first on
    # this process's path (MLflow does): a process started from here with that path, as a loader process is, still
    # imports imagelake's own modules, not the model's copies.
    assert Path(sys.modules["imagelake_served.images"].__file__).parent.parent.name == "code"
    code = f"import sys; sys.path[:] = {sys.path!r}; import imagelake.tasks.data.listing"
    started = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert started.returncode == 0, started.stderr[-600:]

    # Images already decoded (uint8, as the table stores them) through the model's Python object.
    decoded = np.stack([resize_image(data, SIZE)[0] for _, data, _ in given])
    assert list(loaded.unwrap_python_model().predict(None, decoded)["label"]) == list(as_bytes["label"])

    # What the model says about itself: the signature, an input example, the labels as data.
    folder = Path(mlflow.artifacts.download_artifacts(f"models:/{NAME}@champion"))
    inputs = loaded.metadata.get_input_schema().to_dict()
    assert inputs == [{"type": "binary", "name": "image", "required": True}]
    assert {c["name"] for c in loaded.metadata.get_output_schema().to_dict()} == {
        "label",
        "probability",
        "top_k",
        "error",
    }
    assert loaded.metadata.get_params_schema().to_dict() == [
        {"name": "top_k", "default": 3, "shape": None, "type": "long"}
    ]
    assert (folder / "serving_input_example.json").is_file()
    assert json.loads((folder / "artifacts" / "meta.json").read_text(encoding="utf-8"))["labels"] == LABELS


def version_carrying_code(
    client: MlflowClient, tmp_path: Path, marker: Path | None, name: str = NAME, folder_name: str = "carried"
) -> str:
    """A new version of model NAME in a run of its own: the colour model's version 1 program and labels, its pyfunc's
    code changed to write MARKER when loaded (what a registry anyone could write to may hold; MLflow's own loader runs
    that code), or as it was (no MARKER)."""
    import yaml

    folder = tmp_path / folder_name
    shutil.copytree(
        mlflow.artifacts.download_artifacts(f"models:/{NAME}/1", dst_path=str(tmp_path / f"{folder_name}-v1")), folder
    )
    code = Path(yaml.safe_load((folder / "MLmodel").read_text())["flavors"]["python_function"]["model_code_path"]).name
    if marker is not None:
        (folder / code).write_text(
            (folder / code)
            .read_text(encoding="utf-8")
            .replace(
                "    def load_context(self, context) -> None:\n",
                f"    def load_context(self, context) -> None:\n        open({str(marker)!r}, 'w').write('ran')\n",
            ),
            encoding="utf-8",
        )
        assert mlflow.pyfunc.load_model(str(folder)) and marker.exists(), "MLflow runs the code a version carries"
        marker.unlink()
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(folder), "model")
    return client.create_model_version(name, f"{run.info.artifact_uri}/model", run.info.run_id).version


def test_imagelake_reads_the_served_model_and_an_older_one_without_running_their_code(champion, tmp_path: Path) -> None:
    store, _ = champion
    source = tmp_path / "images"
    source.mkdir()
    for name, data, _ in files():
        (source / f"{name}.{'png' if name.endswith('png') else 'jpg'}").write_bytes(data)
    settings = load_settings(overrides={"workspace": str(tmp_path / "ws"), "mlflow_tracking_uri": store})
    client = MlflowClient(store, store)
    # `imagelake predict`: the same decoding rules and labels as the pyfunc (one path), from the program alone.
    found = {
        Path(row["path"]).stem: row["label"] for row in predict_files(client, settings, f"{NAME}@champion", source)
    }
    assert found == {name: label for name, _, label in files()}
    # A version whose code would write a marker when run: `imagelake predict` answers from its program alone.
    marker = tmp_path / "carried-code-ran"
    carrying = version_carrying_code(client, tmp_path, marker)
    carried = predict_files(client, settings, f"{NAME}/{carrying}", source)
    assert {Path(row["path"]).stem: row["label"] for row in carried} == found
    assert not marker.exists(), "imagelake predict never ran the version's code"
    # A version registered by earlier releases (pytorch flavour, labels comma-joined) still predicts.
    older = {Path(row["path"]).stem: row["label"] for row in predict_files(client, settings, f"{NAME}/2", source)}
    plain = ["apples", "leaves", "blueberries"]
    assert older == {name: plain[LABELS.index(label)] for name, _, label in files()}


def test_a_version_saved_before_imagelake_had_one_import_name_still_loads_and_predicts(
    champion, tmp_path: Path
) -> None:
    """Release 0.1.0 installed imagelake's modules as `tasks`, `flows` and `infra`, and saved its pyfunc's code as
    served_model.py (tests/data/served_model_0_1_0.py, as that release wrote it), which falls back on `tasks.rules`
    where its saved rules are missing. A folder laid out as that release saved a version still loads, through MLflow and
    through imagelake, and answers with its label names; no `tasks` module is imported on the way."""
    import pandas as pd
    import yaml

    from imagelake.tasks.registry.loading import load_model_folder

    store, _ = champion
    folder = tmp_path / "model-0.1.0"
    new = Path(mlflow.artifacts.download_artifacts(f"models:/{NAME}/1", dst_path=str(tmp_path / "new")))
    shutil.copytree(new, folder)
    meta = yaml.safe_load((folder / "MLmodel").read_text())
    flavour = meta["flavors"]["python_function"]
    (folder / Path(flavour["model_code_path"]).name).unlink()
    shutil.copyfile(Path(__file__).with_name("data") / "served_model_0_1_0.py", folder / "served_model.py")
    flavour["model_code_path"] = "/checkout/tasks/served_model.py"
    (folder / "MLmodel").write_text(yaml.safe_dump(meta))

    given = files()
    loaded = mlflow.pyfunc.load_model(str(folder))
    answers = loaded.predict(pd.DataFrame({"image": [data for _, data, _ in given]}))
    assert list(answers["label"]) == [label for _, _, label in given]
    program = load_model_folder(folder, NAME, "0.1.0")
    decoded = torch.from_numpy(np.stack([resize_image(data, SIZE)[0] for _, data, _ in given]))
    assert [LABELS[i] for i in program(decoded).argmax(1).tolist()] == [label for _, _, label in given]
    assert not [name for name in sys.modules if name == "tasks" or name.startswith("tasks.")]


def test_scoring_answers_with_imagelake_s_own_served_model_never_the_code_a_version_carries(
    champion, tmp_path: Path
) -> None:
    """A version holding imagelake's program and labels but other code (a registry anyone could write to) is answered by
    this installation's served model: the version's code never runs; a version that is not imagelake's served model
    is refused, before any executor loads it."""
    from imagelake.tasks.inference.batch_scorer import ScoreJob, answer_rows
    from imagelake.tasks.registry.loading import UnsafeModel

    store, _ = champion
    marker = tmp_path / "carried-code-ran"
    version = version_carrying_code(MlflowClient(store, store), tmp_path, marker)
    given = files()
    job = ScoreJob(f"models:/{NAME}/{version}", store, store, None, frozenset())
    answered = answer_rows(job, [(name, "0" * 64, data) for name, data, _ in given])
    assert [row["label"] for row in answered] == [label for _, _, label in given]
    assert not marker.exists(), "scoring never ran the version's own code"

    # Version 2 is a pytorch-flavour program, not imagelake's served model: refused with what to do.
    with pytest.raises(UnsafeModel, match="scoring runs only imagelake's own served model"):
        answer_rows(ScoreJob(f"models:/{NAME}/2", store, store, None, frozenset()), [("a", "0" * 64, given[0][1])])


@pytest.fixture(scope="module")
def served(champion):
    """`mlflow models serve` of the champion on a loopback port, as a consumer would start it."""
    store, root = champion
    port = free_port()
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": store,
        "MLFLOW_REGISTRY_URI": store,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    mlflow_cli = str(Path(sys.executable).parent / "mlflow")
    log = (root / "serve.log").open("w")
    server = subprocess.Popen(
        [
            mlflow_cli,
            "models",
            "serve",
            "-m",
            f"models:/{NAME}@champion",
            "--env-manager",
            "local",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=5):
                break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, (root / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
    yield url
    os.killpg(server.pid, 15)
    server.wait(30)
    log.close()


def invoke(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{url}/invocations", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def test_mlflow_models_serve_answers_png_and_jpeg_files_with_their_label_names(served: str) -> None:
    given = files()
    status, answer = invoke(
        served,
        {
            "dataframe_split": {
                "columns": ["image"],
                "data": [[base64.b64encode(data).decode()] for _, data, _ in given],
            }
        },
    )
    assert status == 200, answer
    assert [row["label"] for row in answer["predictions"]] == [label for _, _, label in given]
    assert all(len(row["top_k"]) == 3 and row["error"] is None for row in answer["predictions"])
    status, answer = invoke(
        served,
        {
            "dataframe_split": {"columns": ["image"], "data": [[base64.b64encode(given[0][1]).decode()]]},
            "params": {"top_k": 2},
        },
    )
    assert status == 200 and len(answer["predictions"][0]["top_k"]) == 2, answer


def test_mlflow_models_serve_answers_a_bad_row_with_its_reason_and_refuses_an_empty_request(served: str) -> None:
    given = files()
    rows = [given[1][1], b"GIF89a but nothing after", given[4][1]]
    status, answer = invoke(
        served,
        {"dataframe_split": {"columns": ["image"], "data": [[base64.b64encode(data).decode()] for data in rows]}},
    )
    assert status == 200, answer
    good, bad, other = answer["predictions"]
    assert (good["label"], other["label"]) == (given[1][2], given[4][2])
    assert bad["label"] is None and bad["probability"] is None and bad["error"], bad
    status, answer = invoke(served, {"dataframe_split": {"columns": ["image"], "data": []}})
    assert status == 400 and "the request has no images" in answer["message"], answer


def test_mlflow_models_serve_bounds_a_request_s_images_and_their_pixels(served: str) -> None:
    """A small body can hold many tiny images or a few huge ones: a request of more than MAX_ROWS images, or whose
    images decode to more pixels than REQUEST_PIXELS_AT_MAX of the largest a model takes, is a 400 naming the bound,
    and the server goes on answering."""
    from imagelake.tasks.inference.served_pyfunc import MAX_ROWS, REQUEST_PIXELS_AT_MAX

    tiny = base64.b64encode(encoded(drawing(0, 1), "PNG")).decode()
    status, answer = invoke(served, {"dataframe_split": {"columns": ["image"], "data": [[tiny]] * (MAX_ROWS + 1)}})
    assert status == 400 and f"a request may hold at most {MAX_ROWS}" in answer["message"], answer
    # The colour model takes at most 10,000,000 pixels an image: 9,000,000-pixel images, one more than the budget.
    big = io.BytesIO()
    Image.new("RGB", (3000, 3000), (200, 30, 30)).save(big, format="PNG")
    rows = [[base64.b64encode(big.getvalue()).decode()]] * (REQUEST_PIXELS_AT_MAX * 10_000_000 // 9_000_000 + 1)
    status, answer = invoke(served, {"dataframe_split": {"columns": ["image"], "data": rows}})
    assert status == 400 and "send them in several requests" in answer["message"], answer
    status, answer = invoke(served, {"dataframe_split": {"columns": ["image"], "data": rows[:2]}})
    assert status == 200 and len(answer["predictions"]) == 2, answer


def test_score_answers_a_folder_a_prefix_and_a_table_version_on_spark_once_per_content_and_model_version(
    champion, spark, s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`imagelake score`'s stage: every image of a folder answered on the executors into the predictions table (a bad
    file with its reason, one row for content found at two paths); a second run answers only what is new to that
    model version; an object-store prefix and a Delta table version's pixels are answered too, content already
    answered skipped."""
    import pyarrow as pa
    from deltalake import DeltaTable

    from imagelake.tasks.rules.schemas import IMAGE_TABLE_SCHEMA
    from imagelake.tasks.stages.score import ScoreSourceError, score_images

    store, _ = champion
    settings = load_settings(overrides={"workspace": str(tmp_path / "ws"), "mlflow_tracking_uri": store})
    folder = tmp_path / "incoming"
    (folder / "nested").mkdir(parents=True)
    given = files()
    for name, data, _ in given:
        (folder / "nested" / f"{name}.{'png' if name.endswith('png') else 'jpg'}").write_bytes(data)
    (folder / "again.png").write_bytes(given[0][1])  # the same content at a second path
    (folder / "broken.png").write_bytes(b"not an image")
    first = score_images(str(folder), f"{NAME}@champion", settings)
    assert (first["images"], first["answered"], first["errors"]) == (8, 7, 1)
    table = DeltaTable(settings.predictions_uri).to_pyarrow_table()
    by_path = {row["path"].rsplit("/", 1)[-1]: row for row in table.to_pylist()}
    assert {name: by_path[name]["label"] for name in by_path if name != "broken.png"} == {
        **{
            f"{name}.{'png' if name.endswith('png') else 'jpg'}": label
            for name, _, label in given
            if name != given[0][0]
        },
        "again.png": LABELS[0],
    }, "the first path in path order keeps a content found twice"
    assert by_path["broken.png"]["label"] is None and by_path["broken.png"]["error"]
    assert {row["model_version"] for row in table.to_pylist()} == {1} and len(by_path["again.png"]["top_k"]) == 3
    assert len(set(table.column("sha256").to_pylist())) == table.num_rows

    (folder / "later.png").write_bytes(encoded(drawing(2, 999), "PNG"))
    second = score_images(str(folder), f"{NAME}/1", settings)
    assert (second["answered"], DeltaTable(settings.predictions_uri).version()) == (1, first["predictions_version"] + 1)
    assert score_images(str(folder), f"{NAME}@champion", settings)["predictions_version"] is None, (
        "nothing new: no commit"
    )

    # A prefix in a bucket (the session's S3-compatible server).
    bucket = s3.filesystem()
    for name, data, _ in given[2:4]:
        bucket.pipe(f"lake/score-{tmp_path.name}/{name}.img", data)
    bucket.pipe(f"lake/score-{tmp_path.name}/{given[2][0]}.png", encoded(drawing(0, 4242), "PNG"))
    remote = score_images(f"s3://lake/score-{tmp_path.name}/", f"{NAME}@champion", settings)
    assert (remote["images"], remote["answered"]) == (1, 1), (
        "only .png (the image_extensions) is listed; its content is new"
    )
    from_bucket = [
        row
        for row in DeltaTable(settings.predictions_uri).to_pyarrow_table().to_pylist()
        if row["source"].startswith("s3://")
    ]
    assert [(row["path"], row["label"]) for row in from_bucket] == [
        (f"s3://lake/score-{tmp_path.name}/{given[2][0]}.png", LABELS[0])
    ]

    # A table version of decoded pixels at the model's size: content answered from the folder is skipped.
    images = tmp_path / "images"
    known = table.column("sha256")[0].as_py()
    pixels = [resize_image(encoded(drawing(1, 7), "PNG"), SIZE)[0].tobytes(), b"\0" * (SIZE * SIZE * 3)]
    rows = {name: [None, None] for name in IMAGE_TABLE_SCHEMA.names}
    rows.update(
        {
            "path": ["file:///a/green.png", "file:///a/known.png"],
            "sha256": ["f" * 64, known],
            "image_size": [SIZE, SIZE],
            "image": pixels,
        }
    )
    from deltalake import write_deltalake

    write_deltalake(str(images), pa.table(rows, schema=IMAGE_TABLE_SCHEMA))
    from_table = score_images(f"{images}@0", f"{NAME}@champion", settings)
    assert (from_table["images"], from_table["answered"], from_table["source"]) == (2, 1, f"file://{images}@0")
    newest = [
        row for row in DeltaTable(settings.predictions_uri).to_pyarrow_table().to_pylist() if row["source_version"] == 0
    ]
    assert [(row["path"], row["label"]) for row in newest] == [("file:///a/green.png", LABELS[1])]
    with pytest.raises(ScoreSourceError, match="not a Delta table"):
        score_images(f"{folder}@3", f"{NAME}@champion", settings)

    # Two runs of one version at once on a new folder (the CLI beside the nightly): they overlap in time, take turns on
    # the predictions table, and each content is answered once.
    import threading

    raced = tmp_path / "raced"
    raced.mkdir()
    for number in range(4):
        (raced / f"{number}.png").write_bytes(encoded(drawing(number % 3, 500 + number), "PNG"))
    before = DeltaTable(settings.predictions_uri).to_pyarrow_table().num_rows
    ready, times, results = threading.Barrier(2), {}, {}

    def race(run: str) -> None:
        ready.wait()
        started = time.monotonic()
        results[run] = score_images(str(raced), f"{NAME}/1", settings)
        times[run] = (started, time.monotonic())

    threads = [threading.Thread(target=race, args=(run,)) for run in ("cli", "nightly")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert times["cli"][0] < times["nightly"][1] and times["nightly"][0] < times["cli"][1], "the two runs overlapped"
    assert sorted(result["answered"] for result in results.values()) == [0, 4], results
    assert DeltaTable(settings.predictions_uri).to_pyarrow_table().num_rows == before + 4

    # Ingest's guards: a link out of the folder, an empty file and one over max_file_bytes are not read; each gets a
    # row whose error names why, once (a second run adds none); a decode that ran out of time is no final answer.
    from imagelake.tasks.inference.batch_scorer import is_final

    guarded = tmp_path / "guarded"
    guarded.mkdir()
    (guarded / "ok.png").write_bytes(encoded(drawing(1, 70), "PNG"))
    (guarded / "empty.png").write_bytes(b"")
    noise = np.random.default_rng(0).integers(0, 255, (120, 120, 3), dtype=np.uint8)
    (guarded / "big.png").write_bytes(encoded(noise, "PNG"))
    (tmp_path / "elsewhere.png").write_bytes(encoded(drawing(2, 71), "PNG"))
    (guarded / "link.png").symlink_to(tmp_path / "elsewhere.png")
    small = settings.model_copy(update={"max_file_bytes": 20_000})
    assert (guarded / "big.png").stat().st_size > 20_000 > (guarded / "ok.png").stat().st_size
    result = score_images(str(guarded), f"{NAME}/1", small)
    assert (result["images"], result["answered"]) == (1, 1), result
    assert result["unread"] == {"empty_file": 1, "file_too_large": 1, "symlink_outside_source": 1}
    rows = DeltaTable(settings.predictions_uri).to_pyarrow_table(columns=["path", "error"]).to_pylist()
    errors = {row["path"].rsplit("/", 1)[-1]: row["error"] for row in rows if "/guarded/" in row["path"]}
    assert errors.keys() == {"ok.png", "empty.png", "big.png", "link.png"} and errors["ok.png"] is None, errors
    assert errors["empty.png"].startswith("empty_file: ") and errors["link.png"].startswith("symlink_outside_source")
    assert errors["big.png"].startswith("file_too_large: ") and "max_file_bytes 20000" in errors["big.png"]
    assert score_images(str(guarded), f"{NAME}/1", small)["errors"] == 0
    rows = DeltaTable(settings.predictions_uri).to_pyarrow_table(columns=["path"]).to_pylist()
    assert sum("/guarded/" in row["path"] for row in rows) == 4, "no second row for a file unchanged"
    assert not is_final("decode_timeout: decoding went on past 30 s (max_decode_seconds)")
    assert is_final("not_an_image: cannot identify image file") and is_final(None)

    # Answers are keyed by the version's run: a model deleted and created again issues version 1 anew, and its answers
    # are its own (keyed by name and number, the new version 1 answered nothing, taken for the old one).
    # The score stage's stored result is keyed by the run too, so `imagelake score` does not reuse the old version's.
    from imagelake.tasks.stages.score import source_state

    client = MlflowClient(store, store)
    client.create_registered_model("recreated")
    old_one = version_carrying_code(client, tmp_path, None, "recreated", "recreated-a")
    old_key = source_state({"source": str(raced), "model": f"recreated/{old_one}", "settings": settings})
    assert score_images(str(raced), f"recreated/{old_one}", settings)["answered"] == 4
    client.delete_registered_model("recreated")
    client.create_registered_model("recreated")
    new_one = version_carrying_code(client, tmp_path, None, "recreated", "recreated-b")
    assert str(new_one) == str(old_one) == "1"
    new_key = source_state({"source": str(raced), "model": f"recreated/{new_one}", "settings": settings})
    assert new_key["source"] == old_key["source"] and new_key != old_key, "the new version 1's key is its own"
    again = score_images(str(raced), f"recreated/{new_one}", settings)
    assert again["answered"] == 4, again
    runs = DeltaTable(settings.predictions_uri).to_pyarrow_table(columns=["model_name", "model_run_id"]).to_pylist()
    assert len({row["model_run_id"] for row in runs if row["model_name"] == "recreated"}) == 2

    # Rounds: the executors write the answers and the driver commits every score_commit_images images. A run that
    # fails in its second round keeps the first round's answers and leaves no file behind; the next run answers only
    # the rest, one commit per round.
    import imagelake.tasks.stages.score as score_stage

    rounds = tmp_path / "rounds"
    rounds.mkdir()
    for number in range(5):
        (rounds / f"{number}.png").write_bytes(encoded(drawing(number % 3, 900 + number), "PNG"))
    by_two = settings.model_copy(update={"score_commit_images": 2})
    real, calls = score_stage.keep_one_per_content, []

    def crash_in_second_round(job, written):
        calls.append(written.num_rows)
        if len(calls) == 2:
            raise RuntimeError("the driver went away")
        return real(job, written)

    before = DeltaTable(settings.predictions_uri)
    monkeypatch.setattr(score_stage, "keep_one_per_content", crash_in_second_round)
    with pytest.raises(RuntimeError, match="went away"):
        score_images(str(rounds), f"{NAME}/1", by_two)
    monkeypatch.setattr(score_stage, "keep_one_per_content", real)
    after = DeltaTable(settings.predictions_uri)
    kept = [row["path"].rsplit("/", 1)[-1] for row in after.to_pyarrow_table().to_pylist() if "/rounds/" in row["path"]]
    assert (calls, sorted(kept), after.version()) == ([2, 2], ["0.png", "1.png"], before.version() + 1)
    folder_files = {path.name for path in Path(settings.predictions_uri.removeprefix("file://")).glob("*.parquet")}
    assert folder_files == {Path(name).name for name in after.file_uris()}, "the failed round's files are removed"
    resumed = score_images(str(rounds), f"{NAME}/1", by_two)
    assert (resumed["images"], resumed["answered"]) == (5, 3), resumed
    resumed_commits = [c for c in DeltaTable(settings.predictions_uri).history() if c["version"] > after.version()]
    assert len(resumed_commits) == 2, "one commit per round of two images (three images, two rounds with answers)"
    every = [
        row for row in DeltaTable(settings.predictions_uri).to_pyarrow_table().to_pylist() if "/rounds/" in row["path"]
    ]
    assert sorted(row["path"].rsplit("/", 1)[-1] for row in every) == [f"{n}.png" for n in range(5)]


def test_the_served_model_s_predict_is_typed_and_mlflow_warns_of_nothing_as_it_loads() -> None:
    # MLflow warned at every import of the served model (twice in a run's console) that its predict took untyped input.
    import subprocess
    import sys

    script = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import imagelake.tasks.inference.served_pyfunc\n"
        "print([str(w.message)[:200] for w in caught if 'type hint' in str(w.message).lower()])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
