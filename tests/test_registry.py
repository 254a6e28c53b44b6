"""The registry: the gate's rule, alias moves and their history, races, operator commands, safe loading."""

from __future__ import annotations

import json
import pickle
import re
import threading
import time
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pytest
import torch
import yaml

from imagelake.infra.tracking import experiment_id, mlflow_client
from imagelake.tasks.registry.aliases import RegistryError, alias_version
from imagelake.tasks.registry.gate import Candidate, gate
from imagelake.tasks.registry.loading import UnsafeModel, load_model_folder, load_registered_model, served_model
from imagelake.tasks.registry.moves import crown, force_promote, history, rollback
from imagelake.tasks.rules.promotion import CHALLENGER, CHAMPION, PREVIOUS, decide_promotion, held_by_baseline
from imagelake.tasks.worker.model import ImageModel

NAME = "digits"


@pytest.mark.parametrize(
    "metric,candidate,champion,margin,promote",
    [
        ("accuracy", 0.9, None, 0.0, True),  # no champion yet
        ("accuracy", 0.9, 0.8, 0.0, True),
        ("accuracy", 0.8, 0.8, 0.0, False),  # a tie does not promote
        ("accuracy", 0.84, 0.8, 0.05, False),  # within the margin
        ("accuracy", 0.86, 0.8, 0.05, True),
        ("macro_f1", 0.70, 0.75, 0.0, False),
        ("loss", 0.30, 0.40, 0.05, True),  # lower is better
        ("loss", 0.40, 0.30, 0.0, False),
        ("loss", 0.36, 0.40, 0.05, False),
    ],
)
def test_the_gate_rule(metric: str, candidate: float, champion: float | None, margin: float, promote: bool) -> None:
    decision = decide_promotion(metric, candidate, champion, margin)
    assert decision.promote is promote
    assert f"{candidate:.4f}" in decision.reason and decision.metric == metric


def test_a_candidate_not_enough_above_its_baseline_is_held_whatever_the_champion() -> None:
    candidate = {"accuracy": 0.70, "loss": 0.9}
    held = held_by_baseline("loss", candidate, 0.68, 0.05)
    assert (
        held is not None
        and not held.promote
        and held.candidate == 0.9
        and "+0.0200 over its baseline's 0.6800" in held.reason
    )
    assert held_by_baseline("accuracy", candidate, 0.60, 0.05) is None, "0.10 above: the champion comparison decides"
    assert held_by_baseline("accuracy", candidate, 0.68, None) is None, "no margin set: shown, not enforced"
    assert held_by_baseline("accuracy", candidate, None, 0.05) is None, (
        "no baseline (a single label): nothing to hold it to"
    )


def test_label_names_survive_the_tag_and_older_comma_joined_tags_still_read() -> None:
    from imagelake.tasks.rules.warm_start import labels_of_tag, labels_tag

    names = ["apples, red", 'say "hi"', "[bracketed]", "Überraschung \U0001f34e", ""]
    assert labels_of_tag(labels_tag(names)) == names
    assert labels_of_tag("cat,dog") == ["cat", "dog"] and labels_of_tag("") == []
    assert labels_of_tag("[not json,other") == ["[not json", "other"], (
        "an old tag whose first name starts with a bracket"
    )


def test_a_champion_proven_unusable_is_replaced_and_one_not_compared_is_kept() -> None:
    decision = decide_promotion(
        "accuracy", 0.2, None, 0.1, champion_unusable="v3: FileNotFoundError: model.pt2 is missing"
    )
    assert decision.promote and "could not be evaluated" in decision.reason and "v3" in decision.reason
    kept = decide_promotion(
        "accuracy", 0.9, None, 0.0, champion_uncompared="v3 could not be evaluated: OutOfMemoryError"
    )
    assert not kept.promote and "stays champion" in kept.reason and "OutOfMemoryError" in kept.reason


@pytest.mark.parametrize(
    "metric,candidate,champion",
    [("accuracy", float("nan"), 0.5), ("accuracy", 1.5, 0.5), ("f2", 0.5, 0.5), ("loss", -1.0, 0.5)],
)
def test_the_gate_rule_refuses_impossible_inputs(metric: str, candidate: float, champion: float) -> None:
    with pytest.raises(ValueError):
        decide_promotion(metric, candidate, champion, 0.0)


def models_and_split() -> tuple[dict[str, torch.nn.Module], np.ndarray, np.ndarray]:
    """Two models and a test split whose labels one of them ("good") predicts perfectly."""
    torch.manual_seed(0)
    good, bad = ImageModel(4).eval(), ImageModel(4).eval()
    images = np.random.default_rng(0).integers(0, 256, (48, 16, 16, 3), dtype=np.uint8)
    with torch.no_grad():
        labels = good(torch.from_numpy(images)).argmax(dim=1).numpy()
    return {"good": good, "bad": bad}, images, labels


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each model of models_and_split saved once, as the promote stage logs it (a pt2 program takes seconds to make);
    the tests register copies."""
    models, images, _ = models_and_split()
    root = tmp_path_factory.mktemp("saved-models")
    for kind, model in models.items():
        mlflow.pyfunc.save_model(
            root / kind, **served_model(root / f"{kind}-parts", model, list("abcd"), 16, "letterbox", None, images[:2])
        )
    return {kind: root / kind for kind in models}


@pytest.fixture
def registry(settings, saved: dict[str, Path]):
    """A SQLite MLflow store, the exported models, and the test split of models_and_split."""
    client = mlflow_client(settings)
    mlflow.set_experiment(experiment_id=experiment_id(client, settings))
    _, images, labels = models_and_split()
    return client, settings, saved, images, labels


def register(model: Path, experiment: str | None = None) -> str:
    """A new version of NAME: a copy of an exported model, logged to a run of its own and registered."""
    with mlflow.start_run(experiment_id=experiment) as run:
        mlflow.log_artifacts(str(model), "model")
    return str(mlflow.register_model(f"runs:/{run.info.run_id}/model", NAME).version)


def moves(settings) -> list[tuple]:
    return [(row["alias"], row["from_version"], row["to_version"], row["action"]) for row in history(settings, NAME)]


def test_the_history_command_lists_a_models_alias_moves_oldest_first_without_asking_for_spark(settings) -> None:
    """The history table is small and written by delta-rs: `imagelake history` reads it here, and answers without the
    seconds a JVM takes to start (or a Spark cluster that is down)."""
    from typer.testing import CliRunner

    from imagelake.flows.cli import app
    from imagelake.infra.spark import spark_asks
    from imagelake.tasks.registry.moves import record

    gated = {"model": NAME, "alias": CHAMPION, "from_version": None, "to_version": "1", "action": "gate"}
    record(settings, [{**gated, "reason": "beats no champion"}, {**gated, "model": "another", "reason": "not this"}])
    record(settings, [{**gated, "from_version": "1", "to_version": "2", "action": "manual", "reason": "by hand"}])
    asked = spark_asks()
    listed = CliRunner().invoke(app, ["history", "--model", NAME, "--set", f"workspace={settings.workspace}"])
    assert listed.exit_code == 0, listed.output
    assert spark_asks() == asked, "the history was read without Spark"
    lines = listed.stdout.splitlines()
    assert len(lines) == 2, lines
    assert re.search(r"champion\s+v- -> v1\s+\[gate\] beats no champion$", lines[0]), lines
    assert re.search(r"champion\s+v1 -> v2\s+\[manual\] by hand$", lines[1]), lines


@pytest.mark.slow
def test_gate_moves_aliases_records_the_decision_and_keeps_history(spark, registry) -> None:
    client, settings, models, images, labels = registry
    bad = register(models["bad"])
    decision, _, _ = gate(client, settings, NAME, Candidate(bad, images, labels, 4))
    assert decision.promote and alias_version(client, NAME, CHAMPION) == bad

    weaker = register(models["bad"])  # the same weights: a tie stays challenger
    decision, _, compared = gate(client, settings, NAME, Candidate(weaker, images, labels, 4))
    tags = client.get_model_version(NAME, weaker).tags
    assert not decision.promote and compared == bad and alias_version(client, NAME, CHALLENGER) == weaker
    assert tags["promotion_decision"] == "not promoted" and "does not beat champion" in tags["promotion_reason"]
    assert tags["compared_with_version"] == bad and tags["candidate_accuracy"] == tags["champion_accuracy"]

    # Better than the champion, but not by min_margin_over_baseline over its own run's baseline: it stays challenger.
    strict = settings.model_copy(update={"min_margin_over_baseline": 0.05})
    held = register(models["good"])
    decision, metrics, _ = gate(client, strict, NAME, Candidate(held, images, labels, 4, baseline=0.98))
    tags = client.get_model_version(NAME, held).tags
    assert metrics["accuracy"] == 1.0 and not decision.promote
    assert (alias_version(client, NAME, CHAMPION), alias_version(client, NAME, CHALLENGER)) == (bad, held)
    assert (
        "+0.0200 over its baseline's 0.9800" in tags["promotion_reason"]
        and "min_margin_over_baseline 0.0500" in tags["promotion_reason"]
    )
    assert tags["baseline_accuracy"] == "0.980000"

    good = register(models["good"])
    decision, metrics, _ = gate(client, strict, NAME, Candidate(good, images, labels, 4, baseline=0.5))
    assert decision.promote and metrics["accuracy"] == 1.0
    assert (alias_version(client, NAME, CHAMPION), alias_version(client, NAME, PREVIOUS)) == (good, bad)
    assert moves(settings) == [
        (CHAMPION, None, bad, "gate"),
        (CHALLENGER, None, weaker, "gate"),
        (CHALLENGER, weaker, held, "gate"),
        (CHAMPION, bad, good, "gate"),
        (PREVIOUS, None, bad, "gate"),
    ]
    assert all(row["who"] and row["reason"] and row["at"] for row in history(settings, NAME))


@pytest.mark.slow
@pytest.mark.parametrize("first", ["good", "bad"])
def test_two_promotions_at_once_never_leave_the_worse_model_champion(spark, registry, first: str) -> None:
    client, settings, models, images, labels = registry
    versions = {kind: register(models[kind]) for kind in (first, "bad" if first == "good" else "good")}
    errors: list[BaseException] = []

    def promote(kind: str) -> None:
        try:
            gate(client, settings, NAME, Candidate(versions[kind], images, labels, 4))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=promote, args=(kind,)) for kind in versions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert alias_version(client, NAME, CHAMPION) == versions["good"]
    champions = [to for alias, _, to, _ in moves(settings) if alias == CHAMPION]
    assert champions[-1] == versions["good"] and len(champions) in (1, 2)


@pytest.mark.slow
def test_rollback_and_forced_promotion_are_recorded_and_refuse_the_impossible(spark, registry) -> None:
    client, settings, models, images, labels = registry
    one = register(models["bad"])
    gate(client, settings, NAME, Candidate(one, images, labels, 4))
    with pytest.raises(RegistryError, match="nothing to roll back to"):
        rollback(client, settings, NAME, "test")
    two = register(models["bad"])
    force_promote(client, settings, NAME, two, "hotfix for a labelling bug")
    assert (alias_version(client, NAME, CHAMPION), alias_version(client, NAME, PREVIOUS)) == (two, one)
    assert rollback(client, settings, NAME, "v2 misbehaves") == (two, one)
    assert (alias_version(client, NAME, CHAMPION), alias_version(client, NAME, PREVIOUS)) == (one, two)
    assert [m for m in moves(settings) if m[3] != "gate"] == [
        (CHAMPION, one, two, "manual"),
        (PREVIOUS, None, one, "manual"),
        (CHAMPION, two, one, "rollback"),
        (PREVIOUS, one, two, "rollback"),
    ]
    with pytest.raises(RegistryError, match="no version '9'"):
        force_promote(client, settings, NAME, "9", "typo")
    with pytest.raises(RegistryError, match="no registered model named 'nope'"):
        rollback(client, settings, "nope", "typo")
    with pytest.raises(RegistryError, match="needs a --reason"):
        force_promote(client, settings, NAME, one, " ")


class Payload:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('payload ran')",))


def test_a_pickled_model_is_refused_and_its_payload_never_runs(registry, tmp_path: Path) -> None:
    client, settings, _, _, _ = registry
    marker = tmp_path / "payload-ran"
    folder = tmp_path / "crafted"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "model.pth").write_bytes(pickle.dumps(Payload(marker)))
    (folder / "MLmodel").write_text(
        yaml.safe_dump({"flavors": {"pytorch": {"model_data": "data", "pytorch_version": str(torch.__version__)}}})
    )
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(folder), "model")
    client.create_registered_model(NAME)
    version = client.create_model_version(NAME, f"{run.info.artifact_uri}/model", run.info.run_id).version
    with pytest.raises(UnsafeModel, match="would unpickle"):
        load_registered_model(client, NAME, str(version))
    assert not marker.exists(), "the crafted pickle was never loaded"
    assert pickle.loads((folder / "data" / "model.pth").read_bytes()) is None and marker.exists(), "the payload is real"


def test_a_program_with_a_pickled_weight_is_refused_and_its_payload_never_runs(tmp_path: Path) -> None:
    """A pt2 program (the served model's, or an older pytorch-flavour one) whose archive stores a weight pickled would
    run code in torch.export.load: imagelake refuses it before loading, whatever allow_pickle_models says (`imagelake
    predict`, the gate's champion, a warm start all load through here)."""
    from tests.test_compat import pickled_program

    marker = tmp_path / "payload-ran"
    folder = tmp_path / "model"
    (folder / "data").mkdir(parents=True)
    pickled_program(folder / "data" / "model.pt2", marker)
    (folder / "MLmodel").write_text(
        yaml.safe_dump({"flavors": {"pytorch": {"model_data": "data", "pytorch_version": str(torch.__version__)}}})
    )
    for allow_pickle in (False, True):
        with pytest.raises(UnsafeModel, match="stores .* pickled"):
            load_model_folder(folder, NAME, "3", allow_pickle=allow_pickle)
    assert not marker.exists(), "the crafted weight was never unpickled"


def a_value_besides_the_default(name: str) -> Any:
    """A valid value of Settings' field NAME other than its default, chosen from its type and bounds."""
    import typing

    from annotated_types import Le, Lt

    from imagelake.infra.settings import Settings

    field = Settings.model_fields[name]
    kind, default = field.annotation, field.default
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Literal:
        return next(choice for choice in args if choice != default)
    if type(None) in args:
        if default is not None:
            return None
        kind = next(arg for arg in args if arg is not type(None))
    if kind is bool:
        return not default
    bounds = [bound.le if isinstance(bound, Le) else bound.lt for bound in field.metadata if isinstance(bound, Le | Lt)]
    if kind is int:
        value = (default or 1) + 1
        return value if not bounds or value <= bounds[0] else default - 1
    return default / 2 if default else 0.5


def test_every_setting_a_model_is_made_of_is_logged_with_its_run_and_restored_by_retrain() -> None:
    """Each setting in the key of the train stage, or of the split and cache it trains on, that says more than where
    things live: a value besides its default is logged as the training run's param of its own name, and retrain sets
    it again; the places (the experiment, the derived stores) are neither."""
    from imagelake.infra.declare import declaration
    from imagelake.infra.settings import Settings, stage_settings
    from imagelake.tasks.registry.lineage import retrain_overrides
    from imagelake.tasks.rules.training import logged_params

    keyed = dict.fromkeys(name for stage in ("split", "cache", "train") for name in stage_settings(stage))
    model = [
        name
        for name in keyed
        if name in Settings.model_fields and not getattr(declaration(Settings, name), "where", False)
    ]
    places = set(keyed) - set(model)
    named = {"shuffle_buffer_batches", "compile", "bf16", "channels_last", "jpeg_decode", "warm_start", "image_size"}
    assert named <= set(model)
    assert places == {"mlflow_experiment", "tracking_uri", "ray_storage_path", "cache_uri"}

    settings = Settings(**{name: a_value_besides_the_default(name) for name in model})
    params = logged_params({"num_classes": 3, "learning_rate": 0.5}, settings)
    assert not places & set(params)
    restored = retrain_overrides({"delta_version": "1", "training_params": json.dumps(params)})
    for name in model:
        assert getattr(settings, name) != Settings.model_fields[name].default, name
        assert restored.get(name) == getattr(settings, name), (name, params.get(name), restored.get(name))
    assert not places & set(restored)


def test_a_version_an_earlier_imagelake_registered_is_retrained_from_its_old_param_names() -> None:
    from imagelake.tasks.registry.lineage import retrain_overrides

    logged = {"arch": "small_cnn", "patience": "3", "min_delta": "0.01", "batch_size": "8", "num_classes": "4"}
    found = {"delta_version": "2", "training_params": json.dumps(logged), "split_settings": '{"val_fraction": 0.2}'}
    assert retrain_overrides(found) == {
        "model_arch": "small_cnn",
        "early_stopping_patience": 3,
        "early_stopping_min_delta": 0.01,
        "batch_size": 8,
        "val_fraction": 0.2,
    }


def test_a_model_versions_recorded_settings_never_turn_on_what_runs_code_or_loads_pickles() -> None:
    import json

    from imagelake.tasks.registry.lineage import retrain_overrides

    found = {
        "delta_version": "3",
        "training_params": json.dumps({}),
        "split_settings": json.dumps({"val_fraction": 0.2, "allow_pickle_models": True, "spark_conf": {"a": "b"}}),
    }
    assert retrain_overrides(found) == {"val_fraction": 0.2}


@pytest.mark.slow
def test_a_champion_the_store_cannot_serve_now_is_kept_and_the_gate_retries(
    spark, registry, tmp_path: Path, monkeypatch
) -> None:
    from imagelake.tasks.registry.gate import ChampionUnreachable
    from tests.servers import MlflowServer

    client, settings, models, images, labels = registry
    store = MlflowServer(tmp_path / "artifact-store", artifacts_only=True).start()
    try:
        monkeypatch.setenv(
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"
        )  # a refused connection fails at once, not after minutes of retries
        remote = client.create_experiment(
            "remote", artifact_location=f"{store.url}/api/2.0/mlflow-artifacts/artifacts/remote"
        )
        champion = register(models["good"], remote)
        gate(client, settings, NAME, Candidate(champion, images, labels, 4))
        candidate = register(models["bad"])  # stored locally: only the champion's store fails

        store.stop()  # the artifact store stops answering
        with pytest.raises(
            ChampionUnreachable, match=rf"champion {NAME} v{champion} could not be fetched .*no alias moved"
        ):
            gate(client, settings, NAME, Candidate(candidate, images, labels, 4))
        assert alias_version(client, NAME, CHAMPION) == champion and alias_version(client, NAME, CHALLENGER) is None
        assert "promotion_decision" not in client.get_model_version(NAME, candidate).tags
        assert moves(settings) == [(CHAMPION, None, champion, "gate")]

        store.start()  # back: the retry compares, and the worse model stays challenger
        decision, _, compared = gate(client, settings, NAME, Candidate(candidate, images, labels, 4))
        assert not decision.promote and compared == champion and alias_version(client, NAME, CHAMPION) == champion
    finally:
        store.stop()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["files gone", "not a model", "other labels"])
def test_a_champion_known_to_be_unusable_is_replaced_with_the_reason(spark, registry, damage: str) -> None:
    import shutil

    client, settings, models, images, labels = registry
    champion = register(models["good"])
    gate(client, settings, NAME, Candidate(champion, images, labels, 4, names=list("abcd")))
    folder = Path(client.get_model_version_download_uri(NAME, champion).removeprefix("file://"))
    if damage == "files gone":
        shutil.rmtree(folder)
    elif damage == "not a model":
        next(folder.rglob("model.pt2")).write_bytes(b"not a program")
    else:  # the same program, registered for labels the candidate's data does not have
        meta = next(folder.rglob("meta.json"))
        meta.write_text(meta.read_text().replace('"d"', '"e"'))
    candidate = register(models["bad"])
    decision, _, _ = gate(client, settings, NAME, Candidate(candidate, images, labels, 4, names=list("abcd")))
    assert decision.promote and alias_version(client, NAME, CHAMPION) == candidate
    assert f"the champion could not be evaluated (v{champion}" in decision.reason
    if damage == "other labels":
        assert "a model for other labels (labels 4 -> 4 (added: d; removed: e))" in decision.reason


@pytest.mark.slow
def test_a_champion_of_another_image_size_is_compared_at_its_own_size_and_kept_when_it_cannot_be(
    spark, registry, tmp_path: Path, monkeypatch
) -> None:
    """The gate evaluates a champion trained at 24 px on the test rows decoded at 24 px; when they cannot be decoded
    at that size, or the champion's evaluation runs out of memory, it stays champion and the candidate is challenger."""
    import imagelake.tasks.registry.gate as registry_module

    client, settings, models, _, _ = registry
    good = models_and_split()[0]["good"]
    big = np.random.default_rng(1).integers(0, 256, (48, 24, 24, 3), dtype=np.uint8)
    small = np.ascontiguousarray(big[:, 4:20, 4:20])  # the candidate's rows at 16 px (a crop will do here)
    with torch.no_grad():
        labels = good(torch.from_numpy(big)).argmax(dim=1).numpy()  # what the 24 px champion answers on its rows
    mlflow.pyfunc.save_model(
        tmp_path / "at24", **served_model(tmp_path / "at24-parts", good, list("abcd"), 24, "letterbox", None, big[:2])
    )
    champion = register(tmp_path / "at24")
    for key, value in {
        "image_size": "24",
        "resize_mode": "letterbox",
        "labels": json.dumps(list("abcd")),
        "training_params": json.dumps({"arch": "small_cnn"}),
    }.items():
        client.set_model_version_tag(NAME, champion, key, value)
    gate(client, settings, NAME, Candidate(champion, big, labels, 4, names=list("abcd")))
    sizes: list[tuple[int, str]] = []

    def at(size: int, mode: str) -> np.ndarray:
        sizes.append((size, mode))
        return big

    candidate = register(models["bad"])
    decision, _, compared = gate(
        client, settings, NAME, Candidate(candidate, small, labels, 4, names=list("abcd"), rows_at=at)
    )
    assert not decision.promote and "does not beat champion 1.0000" in decision.reason, decision.reason
    assert sizes == [(24, "letterbox")] and compared == champion

    def gone(size: int, mode: str) -> np.ndarray:
        raise FileNotFoundError("src/3/x.png")

    real = registry_module.evaluate

    def out_of_memory(model, images, *args):
        if images.shape[1] == 24:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, images, *args)

    for rows_at, why in (
        (gone, "the test rows could not be decoded at that size: FileNotFoundError: src/3/x.png"),
        (None, "the test rows are not at hand"),
        (at, "OutOfMemoryError"),
    ):
        if rows_at is at:
            monkeypatch.setattr(registry_module, "evaluate", out_of_memory)
        other = register(models["good"])  # a candidate that would win any comparison
        decision, _, _ = gate(
            client, settings, NAME, Candidate(other, small, labels, 4, names=list("abcd"), rows_at=rows_at)
        )
        assert not decision.promote and why in decision.reason and "stays champion" in decision.reason, decision.reason
        assert (alias_version(client, NAME, CHAMPION), alias_version(client, NAME, CHALLENGER)) == (champion, other)
        assert client.get_model_version(NAME, other).tags["promotion_decision"] == "not promoted"


@pytest.mark.slow
def test_an_alias_move_cut_short_is_finished_before_the_next_decision(spark, registry) -> None:
    from imagelake.tasks.registry.moves import PENDING_MOVE

    client, settings, models, images, labels = registry
    first = register(models["bad"])
    gate(client, settings, NAME, Candidate(first, images, labels, 4))
    history_folder = Path(settings.history_uri)
    shutil_move = history_folder.with_name("history-away")
    history_folder.rename(shutil_move)
    history_folder.write_text(
        "not a folder: the history cannot be written"
    )  # the run dies between the aliases and the history
    better = register(models["good"])
    with pytest.raises(Exception):  # noqa: B017 - any error will do: the run only has to die before the history
        gate(client, settings, NAME, Candidate(better, images, labels, 4))
    assert PENDING_MOVE in client.get_registered_model(NAME).tags, "the move was written down before it began"

    history_folder.unlink()
    shutil_move.rename(history_folder)
    third = register(models["bad"])
    decision, _, compared = gate(client, settings, NAME, Candidate(third, images, labels, 4))
    assert compared == better and not decision.promote, (
        "the cut-short move was finished first: the next gate compares with its champion"
    )
    assert PENDING_MOVE not in client.get_registered_model(NAME).tags
    assert (alias_version(client, NAME, CHAMPION), alias_version(client, NAME, PREVIOUS)) == (better, first)
    assert moves(settings) == [
        (CHAMPION, None, first, "gate"),
        (CHAMPION, first, better, "gate"),
        (PREVIOUS, None, first, "gate"),
        (CHALLENGER, None, third, "gate"),
    ], "every move has its history row, once"


def test_a_holder_paused_past_its_lease_gives_up_a_move_another_run_made_meanwhile(
    spark, registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fence passes, then the holder pauses past its lease, and another run moves the champion: when the paused
    holder goes on, it finds the alias moved at write time and gives its move up (the other run's champion stays); its
    written-down move is dropped, not finished, by the next holder."""
    import imagelake.tasks.registry.moves as registry_models
    from imagelake.tasks.registry.moves import PENDING_MOVE, MovedMeanwhile, crown, finish_pending_move

    client, settings, models, images, labels = registry
    first, mine, theirs = (register(models[kind]) for kind in ("bad", "good", "bad"))
    crown(client, settings, NAME, first, "manual", "the champion before")
    real_fence, fenced = registry_models.fence, []

    def pause_after_the_fence(what: str) -> None:
        real_fence(what)
        fenced.append(what)
        if len(fenced) == 2:  # the fence before the champion is set passed: now the pause, and another run's move
            client.set_registered_model_alias(NAME, CHAMPION, theirs)

    monkeypatch.setattr(registry_models, "fence", pause_after_the_fence)
    with pytest.raises(MovedMeanwhile, match=rf"{NAME}@champion points at v{theirs} now, moved by another run"):
        crown(client, settings, NAME, mine, "manual", "decided before the pause")
    monkeypatch.setattr(registry_models, "fence", real_fence)
    assert alias_version(client, NAME, CHAMPION) == theirs
    assert PENDING_MOVE in client.get_registered_model(NAME).tags
    assert finish_pending_move(client, settings, NAME) and PENDING_MOVE not in client.get_registered_model(NAME).tags
    assert (alias_version(client, NAME, CHAMPION), alias_version(client, NAME, PREVIOUS)) == (theirs, None)


@pytest.mark.slow
def test_two_hosts_promoting_at_once_are_serialised_by_the_prefect_server(
    prefect_api: str, saved: dict[str, Path], tmp_path: Path
) -> None:
    """Two processes with their own workspaces (no file lock in common, as on two hosts), one MLflow server and one
    Prefect server: the second gate compares with the model the first crowned, never with the champion both saw."""
    import json
    import subprocess
    import sys

    from imagelake.infra.settings import load_settings
    from tests.conftest import REPO, cli_env
    from tests.servers import MlflowServer

    server = MlflowServer(tmp_path / "mlflow").start()
    try:
        shared = {
            "IMAGELAKE_MLFLOW_TRACKING_URI": server.url,
            "IMAGELAKE_TABLE_ROOT": str(tmp_path / "tables"),
            "IMAGELAKE_PREFECT_API_URL": prefect_api,
            "IMAGELAKE_MODEL_NAME": NAME,
        }
        settings = load_settings(
            overrides={
                "workspace": str(tmp_path / "ws-0"),
                "mlflow_tracking_uri": server.url,
                "table_root": str(tmp_path / "tables"),
                "prefect_api_url": prefect_api,
            }
        )
        client = mlflow_client(settings)
        mlflow.set_tracking_uri(server.url)
        mlflow.set_experiment(experiment_id=experiment_id(client, settings))
        models, (_, images, labels) = saved, models_and_split()
        np.savez(tmp_path / "split.npz", images=images, labels=labels)
        champion = register(models["bad"])
        gate(client, settings, NAME, Candidate(champion, images, labels, 4))
        candidates = [register(models["good"]) for _ in range(2)]  # both beat the champion; they tie with each other

        go = tmp_path / "go"
        racers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.gate_racer",
                    NAME,
                    version,
                    str(tmp_path / "split.npz"),
                    str(go),
                    str(tmp_path / f"out-{version}.json"),
                ],
                cwd=REPO,
                env=cli_env({**shared, "IMAGELAKE_WORKSPACE": str(tmp_path / f"ws-{version}")}),
            )
            for version in candidates
        ]
        deadline = time.monotonic() + 120
        while (
            not all((tmp_path / f"out-{version}.json.ready").exists() for version in candidates)
            and time.monotonic() < deadline
            and all(r.poll() is None for r in racers)
        ):
            time.sleep(0.1)  # until both have loaded what they need and wait for the signal
        assert all((tmp_path / f"out-{version}.json.ready").exists() for version in candidates), (
            "both racers ready before the signal: else there is no race"
        )
        go.touch()
        assert [racer.wait(300) for racer in racers] == [0, 0]
        results = {version: json.loads((tmp_path / f"out-{version}.json").read_text()) for version in candidates}
        first, second = (results[version] for version in candidates)
        assert first["started"] < second["ended"] and second["started"] < first["ended"], "the two gates overlapped"
        winner = next(version for version, result in results.items() if result["promoted"])
        loser = next(version for version in candidates if version != winner)
        assert results[winner]["compared_with"] == champion and not results[loser]["promoted"]
        assert results[loser]["compared_with"] == winner, (
            "the second gate saw the first's champion: the two were serialised"
        )
        assert (
            alias_version(client, NAME, CHAMPION),
            alias_version(client, NAME, PREVIOUS),
            alias_version(client, NAME, CHALLENGER),
        ) == (winner, champion, loser)
    finally:
        mlflow.set_tracking_uri(None)
        server.stop()


@pytest.mark.slow
def test_an_alias_move_under_a_lapsed_lease_is_refused_while_another_holder_is_in(
    prefect_api: str, spark, registry
) -> None:
    """The registry lock's Prefect lease lapses (the server drops it, as it does when a holder cannot renew in time) and
    a second host takes the lock: the first holder's alias move and history row are fenced off, and nothing moves."""
    from imagelake.infra.lease import LeaseLost, acquire, client_of
    from imagelake.infra.prefect_env import _leases, lock_name
    from imagelake.tasks.registry.moves import lock_of, registry_lock

    client, settings, models, images, labels = registry
    settings = settings.model_copy(update={"prefect_api_url": prefect_api})
    champion = register(models["good"])
    gate(client, settings, NAME, Candidate(champion, images, labels, 4))
    other = register(models["bad"])
    with registry_lock(settings, NAME):
        lease = _leases.get()[lock_of(NAME)]
        with client_of(prefect_api) as prefect:
            prefect.release_concurrency_slots_with_lease(lease.lease_id)  # lapsed: the slot is free again
        second = acquire(prefect_api, lock_name(lock_of(NAME)), timeout=30)  # another host enters
        try:
            with pytest.raises(
                LeaseLost, match=rf"the lock .*registry-{NAME}.* may be held by another run now .*nothing was changed"
            ):
                crown(client, settings, NAME, other, "manual", "a move under a lapsed lease")
        finally:
            second.release()
    assert alias_version(client, NAME, CHAMPION) == champion and moves(settings) == [(CHAMPION, None, champion, "gate")]
    assert "imagelake.pending_move" not in client.get_registered_model(NAME).tags, "not even written down"
    with registry_lock(settings, NAME):  # a lease that holds fences nothing
        crown(client, settings, NAME, other, "manual", "a move under a lease that holds")
    assert alias_version(client, NAME, CHAMPION) == other


@pytest.mark.slow
def test_the_promote_stage_retries_a_champion_the_store_cannot_serve_and_then_compares_with_it(
    spark, digits_cached, settings, prefect_api: str, tmp_path: Path, monkeypatch
) -> None:
    """The promote stage itself, in a flow on a real Prefect server: its first attempt finds the champion's artifact
    store down and fails with no alias moved; Prefect retries it once the store is back, and the gate compares."""
    from prefect import flow

    from imagelake.infra.prefect_env import stage_results
    from imagelake.tasks.stages.promote import promote
    from imagelake.tasks.stages.train import train_model
    from tests.servers import MlflowServer, PatientClient

    settings = settings.model_copy(
        update={"image_size": 24, "max_epochs": 1, "num_workers": 1, "batch_size": 16, "model_name": NAME}
    )
    client = mlflow_client(settings)
    mlflow.set_experiment(experiment_id=experiment_id(client, settings))
    store = MlflowServer(tmp_path / "artifact-store", artifacts_only=True).start()
    try:
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        remote = client.create_experiment(
            "remote", artifact_location=f"{store.url}/api/2.0/mlflow-artifacts/artifacts/remote"
        )
        torch.manual_seed(0)
        images = np.random.default_rng(0).integers(0, 256, (4, 24, 24, 3), dtype=np.uint8)
        mlflow.pytorch.save_model(
            ImageModel(len(digits_cached.labels)).eval(),
            tmp_path / "untrained",
            input_example=images,
            serialization_format="pt2",
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],  # not inferred in a process of its own
        )
        champion = register(tmp_path / "untrained", remote)
        crown(client, settings, NAME, champion, "gate", "first")
        trained = train_model(digits_cached, settings)
        store.stop()

        aliases_when_failed: list[str | None] = []

        def store_back_then_decide(task, task_run, failed) -> bool:
            """Prefect calls this when an attempt has failed: note the champion then, start the store again and wait for
            it to answer, then let the stage's own condition decide whether to retry."""
            aliases_when_failed.append(alias_version(client, NAME, CHAMPION))
            store.start()
            return promote.retry_condition_fn(task, task_run, failed)

        @flow
        def promote_only():
            with stage_results(settings):
                # The stage as the pipeline declares it, with its own retry condition; the store is back before it runs.
                stage = promote.with_options(
                    retry_delay_seconds=0, retry_jitter_factor=0, retry_condition_fn=store_back_then_decide
                )
                return stage(trained, digits_cached, settings, return_state=True)

        state = promote_only()
        promoted = state.result()
        assert aliases_when_failed == [champion], "the first attempt failed and moved no alias"
        with PatientClient(base_url=prefect_api, timeout=30) as api:
            task_run = api.get(f"/task_runs/{state.state_details.task_run_id}").json()
        assert task_run["run_count"] == 2 and task_run["state_type"] == "COMPLETED", task_run
        assert "could not be evaluated" not in promoted.decision and re.search(
            r"champion \d\.\d{4}", promoted.decision
        ), "compared with the champion"
        assert alias_version(client, NAME, CHAMPION) == (
            promoted.model_version if promoted.alias == CHAMPION else champion
        )
    finally:
        store.stop()


CROWN_AND_DIE = """
import os, sys
from mlflow import MlflowClient
from imagelake.infra.settings import load_settings
from imagelake.infra.tracking import mlflow_client
from imagelake.tasks.registry.moves import crown, registry_lock

real = MlflowClient.set_registered_model_alias

def dies_between_the_aliases(self, name, alias, version):
    if alias == "previous-champion":
        os._exit(9)  # the process dies here: no exception handler, no finally block runs
    return real(self, name, alias, version)

MlflowClient.set_registered_model_alias = dies_between_the_aliases
settings = load_settings(overrides={"workspace": sys.argv[1]})
with registry_lock(settings, sys.argv[2]):
    crown(mlflow_client(settings), settings, sys.argv[2], sys.argv[3], "gate", "better")
"""


@pytest.mark.slow
def test_a_process_killed_between_the_champion_and_previous_champion_moves_leaves_a_move_the_next_gate_finishes(
    spark, registry
) -> None:
    import subprocess
    import sys

    from imagelake.tasks.registry.moves import PENDING_MOVE
    from tests.conftest import REPO, cli_env

    client, settings, models, images, labels = registry
    first = register(models["bad"])
    gate(client, settings, NAME, Candidate(first, images, labels, 4))
    better = register(models["good"])
    died = subprocess.run(
        [sys.executable, "-c", CROWN_AND_DIE, str(settings.workspace_dir), NAME, better],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert died.returncode == 9, died.stderr[-3000:]
    # Half a move: the champion moved, previous-champion and the history did not; the move is written down.
    assert (alias_version(client, NAME, CHAMPION), alias_version(client, NAME, PREVIOUS)) == (better, None)
    assert PENDING_MOVE in client.get_registered_model(NAME).tags
    assert moves(settings) == [(CHAMPION, None, first, "gate")]

    third = register(models["bad"])
    decision, _, compared = gate(client, settings, NAME, Candidate(third, images, labels, 4))
    assert compared == better and not decision.promote
    assert (alias_version(client, NAME, CHAMPION), alias_version(client, NAME, PREVIOUS)) == (better, first)
    assert PENDING_MOVE not in client.get_registered_model(NAME).tags
    assert moves(settings) == [
        (CHAMPION, None, first, "gate"),
        (CHAMPION, first, better, "gate"),
        (PREVIOUS, None, first, "gate"),
        (CHALLENGER, None, third, "gate"),
    ], "the cut-short move's rows land once, with the rest of it"


def test_the_history_records_the_user_setting_or_the_login_name(monkeypatch) -> None:
    import getpass

    from imagelake.infra.settings import load_settings
    from imagelake.tasks.registry.moves import who

    monkeypatch.delenv("IMAGELAKE_USER", raising=False)
    assert who(load_settings()) == getpass.getuser()
    assert who(load_settings(overrides={"user": "release-bot"})) == "release-bot"
    monkeypatch.setenv("IMAGELAKE_USER", "ops")
    assert who(load_settings()) == "ops"
