"""Training: worker loss and retries resume from checkpoints, the models, the loader's tensors."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import pytest
import ray.train
import torch

from imagelake.infra.tracking import mlflow_client
from imagelake.tasks.rules.training import scaled_learning_rate
from imagelake.tasks.stages.cache import Stored, cache_splits
from imagelake.tasks.stages.split import plan_splits
from imagelake.tasks.stages.train import run_name, train_model
from imagelake.tasks.worker.train_loop import (
    CheckpointUnusable,
    make_model,
    make_trainer,
    resume_checkpoint,
)
from tests.faults import KillWorkerOnce, inject
from tests.lake import Lake, copy_digits


def epochs_logged(settings, run_id: str) -> list[int]:
    return sorted(m.step for m in mlflow_client(settings).get_metric_history(run_id, "val_loss"))


def assert_resumed(settings, run_id: str) -> None:
    """The run went on from a checkpoint (epoch 0 trained once), not from scratch, and finished every epoch.

    An epoch whose checkpoint Ray had not registered when the worker died is trained again, so it may be logged twice.
    """
    resumed = int(mlflow_client(settings).get_run(run_id).data.tags["resumed_after_epoch"])
    logged = epochs_logged(settings, run_id)
    assert resumed >= 0 and logged.count(0) == 1 and set(logged) == {0, 1, 2, 3}
    assert all(logged.count(epoch) == 1 for epoch in range(resumed + 1)), f"epochs up to {resumed} ran once: {logged}"


@pytest.mark.slow
def test_a_worker_killed_mid_run_resumes_from_the_last_checkpoint(
    digits_cached, settings, tmp_path: Path, monkeypatch
) -> None:
    marker = tmp_path / "killed"
    inject(monkeypatch, KillWorkerOnce(1, 2, str(marker)))
    settings = settings.model_copy(
        update={"max_epochs": 4, "early_stopping_patience": 10, "max_failures": 1, "batch_size": 16}
    )
    trained = train_model(digits_cached, settings)
    assert marker.read_text().startswith("killed at epoch 2"), "rank 1 was killed once"
    assert trained.epochs_run == 4
    assert trained.fit_seconds > 0, "rank 0 logs how long the fitting took"
    assert_resumed(settings, trained.mlflow_run_id)


@pytest.mark.slow
def test_a_retried_training_task_resumes_the_same_run(
    spark, lake: Lake, digits_dir: Path, settings, tmp_path: Path, monkeypatch
) -> None:
    """Also over a JPEG cache, read by a loader process: the run resumes from the checkpoint whatever the loader."""
    copy_digits(digits_dir, tmp_path / "src", labels=tuple(str(d) for d in range(10)), per_label=10)
    _, _, written = lake.run(tmp_path / "src")
    plan = plan_splits(spark, written, settings.model_copy(update={"image_size": 24}))
    cached = cache_splits(spark, plan, 24, settings.cache_uri, stored=Stored("jpeg", 95))
    assert cached.image_format == "jpeg"
    marker = tmp_path / "killed"
    inject(monkeypatch, KillWorkerOnce(1, 2, str(marker)))
    settings = settings.model_copy(
        update={
            "max_epochs": 4,
            "early_stopping_patience": 10,
            "max_failures": 0,
            "batch_size": 16,
            "loader_processes": 1,
        }
    )
    interrupt = signal.getsignal(signal.SIGINT)
    with pytest.raises(ray.train.TrainingFailedError):
        train_model(cached, settings)  # no failures allowed: the run fails, as a Prefect task attempt would
    assert marker.exists()
    # Ray Train's fit() sets a SIGINT handler of its own (to abort its controller) and leaves it: a later stage's
    # deadline or a cancel would be swallowed by it. The stage puts back the one it found, failed or not.
    assert signal.getsignal(signal.SIGINT) is interrupt, signal.getsignal(signal.SIGINT)
    client = mlflow_client(settings)
    (first,) = client.search_runs([client.get_experiment_by_name(settings.mlflow_experiment).experiment_id])
    assert first.info.status == "FAILED" and epochs_logged(settings, first.info.run_id) == [0, 1]
    # The retry: same data and settings, so the same Ray run (and MLflow run) continues from its checkpoint.
    trained = train_model(cached, settings)
    assert signal.getsignal(signal.SIGINT) is interrupt, signal.getsignal(signal.SIGINT)
    assert trained.run_name == run_name(cached, settings) and trained.mlflow_run_id == first.info.run_id
    assert trained.epochs_run == 4
    assert_resumed(settings, trained.mlflow_run_id)
    artifacts = {a.path for a in client.list_artifacts(trained.mlflow_run_id)}
    assert "learning_curves.png" in artifacts


@pytest.mark.slow
def test_the_same_data_settings_and_seed_train_the_same_model(digits_cached, settings, tmp_path: Path) -> None:
    """Two trainings from scratch on two workers (DDP: the harder case; one worker is the same loop without the
    all-reduce): every epoch's metrics and the best checkpoint's weights are the same."""
    settings = settings.model_copy(update={"max_epochs": 3, "batch_size": 8, "num_workers": 2, "loader_workers": 3})
    runs = [
        train_model(digits_cached, settings.model_copy(update={"ray_storage_root": str(tmp_path / f"ray-{i}")}))
        for i in range(2)
    ]
    client = mlflow_client(settings)
    histories = [
        {
            name: [m.value for m in sorted(client.get_metric_history(t.mlflow_run_id, name), key=lambda m: m.step)]
            for name in ("train_loss", "val_loss", "val_acc")
        }
        for t in runs
    ]
    assert runs[0].mlflow_run_id != runs[1].mlflow_run_id and len(histories[0]["val_loss"]) == 3
    assert histories[0] == histories[1], f"{histories[0]} != {histories[1]}"
    weights = [torch.load(t.checkpoint_path, map_location="cpu", weights_only=False)["state_dict"] for t in runs]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    # Ray's report callback staged each epoch's checkpoint in the system's temporary folder; the runs left nothing
    # there (infra/compat.py:report_callback_staging).
    staging = f"lightning_checkpoints-*-name={runs[0].run_name}"
    staged = [path.name for path in Path(tempfile.gettempdir()).glob(staging)]
    assert not staged, f"left in the temporary folder: {staged}"


def _checkpoint(folder: Path, epoch: int, good: bool = True) -> Path:
    folder.mkdir(parents=True)
    path = folder / "checkpoint.ckpt"
    if good:
        torch.save({"state_dict": {"w": torch.zeros(1)}, "epoch": epoch}, path)
    else:
        path.write_bytes(b"not a checkpoint, the end of a file cut short")
    return path


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    run = tmp_path / "train-run"
    previous = _checkpoint(run / "trial" / "checkpoint_000001", 1)
    latest = run / "trial" / "checkpoint_000002"
    _checkpoint(latest, 2, good=False)
    assert resume_checkpoint(str(latest), str(run)) == str(previous)
    assert resume_checkpoint(None, str(run)) is None, "nothing to resume: a fresh run"


def test_no_readable_checkpoint_fails_clearly_instead_of_starting_over(tmp_path: Path) -> None:
    run = tmp_path / "train-run"
    latest = run / "trial" / "checkpoint_000002"
    _checkpoint(run / "trial" / "checkpoint_000001", 1, good=False)
    _checkpoint(latest, 2, good=False)
    with pytest.raises(CheckpointUnusable, match="none of its checkpoints can be read"):
        resume_checkpoint(str(latest), str(run))


@pytest.mark.parametrize("rule,expected", [("linear", 4e-3), ("sqrt", 2e-3), ("none", 1e-3)])
def test_learning_rate_scales_with_the_workers(rule: str, expected: float) -> None:
    assert scaled_learning_rate(1e-3, 4, rule) == pytest.approx(expected)


def test_the_baseline_fits_a_random_sample_of_the_same_split_and_beats_chance(digits_cached) -> None:
    """The run's floor reads the cached splits as training does: thumbnails of the chosen rows, at most `limit` of
    them."""
    import numpy as np
    import torch.nn.functional as F

    from imagelake.tasks.registry.baseline import fit_baseline, thumbnails
    from imagelake.tasks.stages.promote import read_split

    splits, counts = digits_cached.splits, digits_cached.counts
    whole = fit_baseline(splits["train"], splits["test"], 24, counts, seed=0)
    assert (whole.train_rows, whole.test_rows) == (counts["train"], counts["test"])
    assert whole.accuracy > 0.3, f"chance is 0.1; got {whole.accuracy}"
    assert fit_baseline(splits["train"], splits["test"], 24, counts, seed=0, limit=20).train_rows == 20
    images, labels = read_split(splits["train"], 24)
    some, their_labels = thumbnails(splits["train"], 24, counts["train"], limit=5, seed=3)
    chosen = np.sort(np.random.default_rng(3).choice(len(labels), size=5, replace=False))
    expected = (
        F.adaptive_avg_pool2d(torch.from_numpy(images[chosen]).permute(0, 3, 1, 2).float(), 32).flatten(1).numpy() / 255
    )
    assert np.allclose(some, expected, atol=1e-6) and (their_labels == labels[chosen]).all()


def gpu_config() -> dict:
    return {
        "train_uri": "",
        "val_uri": "",
        "num_classes": 10,
        "image_size": 32,
        "arch": "small_cnn",
        "learning_rate": 1e-3,
        "batch_size": 8,
        "max_epochs": 1,
        "patience": 1,
        "min_delta": 0.0,
        "seed": 0,
        "use_gpu": True,
    }


def test_gpu_settings_are_no_ops_without_a_gpu(tmp_path: Path) -> None:
    config = gpu_config()
    assert not torch.cuda.is_available()
    assert make_trainer(config, [], 1, 1, accelerator="cpu").precision == "32-true"
    assert make_model(config).model.channels_last is False


def test_gpu_settings_turn_on_bf16_and_channels_last_on_a_gpu(tmp_path: Path, monkeypatch) -> None:
    # No GPU exists here: only the check for one is replaced, the trainer and model are real.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = gpu_config()
    assert make_trainer(config, [], 1, 1, accelerator="cpu").precision == "bf16-mixed"
    model = make_model(config)
    assert model.model.channels_last is True and model.model.net.features[0][0].weight.is_contiguous(
        memory_format=torch.channels_last
    )
    assert make_trainer({**config, "bf16": False}, [], 1, 1, accelerator="cpu").precision == "32-true"
    assert make_model({**config, "channels_last": False}).model.channels_last is False


def test_a_ray_strategy_of_another_lightning_package_is_refused_before_training() -> None:
    """Where the `lightning` package is installed too, Ray Train's strategy is built on it and cannot drive imagelake's
    pytorch_lightning Trainer: the train stage says so before starting Ray (a real strategy of another Lightning
    package, lightning_fabric's, stands in for lightning.pytorch's, which this environment does not install)."""
    from lightning_fabric.strategies import DDPStrategy as FabricDDPStrategy

    from imagelake.tasks.worker.train_loop import ray_lightning_problem

    assert ray_lightning_problem() is None
    problem = ray_lightning_problem(FabricDDPStrategy)
    assert problem is not None and "lightning_fabric" in problem and "pip uninstall lightning" in problem


def test_a_compiled_model_trains_its_own_weights_checkpoints_under_the_plain_names_resumes_and_registers(
    tmp_path: Path,
) -> None:
    """torch.compile in the training path (Inductor on the CPU here): steps run through the compiled module, the
    weights it trains are the model's own, and a checkpoint holds the plain model's names, so it loads into an
    uncompiled classifier (warm start reads the same state dict), a compiled run resumes from it, and the promote
    stage's export of it serves the same answers. A mode that does not exist is refused naming the setting."""
    config = {**gpu_config(), "use_gpu": False, "image_size": 16, "compile": "default"}
    torch.manual_seed(0)
    model = make_model(config)
    assert type(model._step_model).__name__ == "OptimizedModule" and model._step_model is not model.model
    before = {name: tensor.clone() for name, tensor in model.model.state_dict().items()}
    images = torch.randint(0, 256, (8, 16, 16, 3), dtype=torch.uint8)
    labels = torch.randint(0, 10, (8,))
    trainer = make_trainer(config, [], 2, 1, accelerator="cpu")
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=4)
    trainer.fit(model, train_dataloaders=batches, val_dataloaders=batches)
    trainer.save_checkpoint(tmp_path / "compiled.ckpt")
    state = torch.load(tmp_path / "compiled.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert not [name for name in state if "_orig_mod" in name or "_step_model" in name]
    trained = model.model.state_dict()
    assert any(not torch.equal(before[name], trained[name]) for name in before), (
        "the compiled steps moved the model's weights"
    )
    plain = make_model({**config, "compile": None})
    assert type(plain._step_model).__name__ != "OptimizedModule"
    plain.load_state_dict(state)
    model.eval(), plain.eval()
    with torch.no_grad():
        assert torch.allclose(model._step_model(images), plain.model(images), atol=1e-4)
    # Resumed from that checkpoint, compiled again: training goes on at the next epoch with the saved weights.
    resumed = make_model(config)
    again = make_trainer({**config, "max_epochs": 2}, [], 2, 1, accelerator="cpu")
    again.fit(resumed, train_dataloaders=batches, val_dataloaders=batches, ckpt_path=tmp_path / "compiled.ckpt")
    assert again.current_epoch == 2 and type(resumed._step_model).__name__ == "OptimizedModule"
    # Registered as the promote stage registers: the plain model of the checkpoint, a pt2 program in the served pyfunc.
    import mlflow

    from imagelake.tasks.registry.loading import served_model
    from imagelake.tasks.stages.promote import load_trained_model

    exported = load_trained_model(str(tmp_path / "compiled.ckpt"))
    labels = [str(n) for n in range(10)]
    mlflow.pyfunc.save_model(
        tmp_path / "registered",
        **served_model(tmp_path / "parts", exported, labels, 16, "letterbox", None, images[:2].numpy()),
    )
    served = mlflow.pyfunc.load_model(str(tmp_path / "registered"))
    with torch.no_grad():
        probabilities = torch.softmax(plain.model(images), dim=1)
    answered = served.unwrap_python_model().predict(None, images.numpy(), params={"top_k": 10})
    assert list(answered["label"]) == [labels[i] for i in probabilities.argmax(dim=1)]
    got = torch.tensor(
        [[entry["probability"] for entry in sorted(top, key=lambda e: int(e["label"]))] for top in answered["top_k"]]
    )
    assert torch.allclose(got, probabilities, atol=1e-4)
    with pytest.raises(ValueError, match="compile mode 'fastest'"):
        make_model({**config, "compile": "fastest"})
    # The setting: unset, the faster way measured for the model with a GPU (tasks/rules/training.py), eager on a CPU;
    # on or off; or a mode.
    from imagelake.tasks.worker.train_loop import compile_mode

    gpu = torch.cuda.is_available()
    assert compile_mode({"arch": "resnet50", "use_gpu": True}) == ("default" if gpu else None)
    assert compile_mode({"arch": "mobilenet_v2", "use_gpu": True}) is None
    assert compile_mode({"arch": "resnet50", "use_gpu": False}) is None
    assert compile_mode({"arch": "resnet50", "compile": False, "use_gpu": True}) is None
    assert (
        compile_mode({"arch": "small_cnn", "compile": True}) == "default"
        and compile_mode({"arch": "small_cnn", "compile": "reduce-overhead"}) == "reduce-overhead"
    )
