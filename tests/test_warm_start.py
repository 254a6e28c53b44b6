"""Warm start: the rule that decides whether a run may start from the champion's weights, and a real run that does."""

from __future__ import annotations

import pytest
import torch

from imagelake.infra.tracking import mlflow_client
from imagelake.tasks.registry.loading import load_registered_model
from imagelake.tasks.rules.promotion import CHAMPION
from imagelake.tasks.rules.warm_start import Champion, WeightsShape, decide_warm_start, shape_from_tags
from imagelake.tasks.stages.promote import promote_model
from imagelake.tasks.stages.train import train_model, warm_start_key, warm_start_of
from imagelake.tasks.worker.model import ImageModel
from tests.conftest import DIGITS

SHAPE = WeightsShape(labels=DIGITS, image_size=24, model_arch="small_cnn", resize_mode="letterbox")


@pytest.mark.parametrize(
    "champion,version,reason",
    [
        (Champion("3", SHAPE), "3", "same labels"),
        (None, None, "no champion"),
        (Champion("3", None), None, "does not record"),
        (
            Champion("3", WeightsShape(DIGITS[:5], 24, "small_cnn", "letterbox")),
            None,
            "labels 5 -> 10 (added: 5, 6, 7, 8, 9)",
        ),
        (
            Champion("3", WeightsShape(tuple(reversed(DIGITS)), 24, "small_cnn", "letterbox")),
            None,
            "labels in another order",
        ),
        (Champion("3", WeightsShape(DIGITS, 32, "small_cnn", "letterbox")), None, "image_size 32 -> 24"),
        (Champion("3", WeightsShape(DIGITS, 24, "resnet18", "letterbox")), None, "model_arch resnet18 -> small_cnn"),
        (
            Champion("3", WeightsShape(DIGITS, 24, "small_cnn", "center_crop")),
            None,
            "resize_mode center_crop -> letterbox",
        ),
    ],
)
def test_a_run_warm_starts_only_from_a_champion_trained_for_the_same_labels_and_shape(
    champion, version, reason: str
) -> None:
    decided = decide_warm_start(SHAPE, champion)
    assert decided.version == version and reason in decided.reason
    assert decided.source == (version or "none")


@pytest.mark.parametrize(
    "tags,shape",
    [
        (
            {
                "labels": "0,1",
                "image_size": "24",
                "resize_mode": "letterbox",
                "training_params": '{"arch": "small_cnn"}',
            },
            WeightsShape(("0", "1"), 24, "small_cnn", "letterbox"),
        ),
        (
            {"labels": "0,1", "image_size": "24", "resize_mode": "letterbox"},
            None,
        ),  # no training params: not the pipeline's
        (
            {
                "labels": "0,1",
                "image_size": "big",
                "resize_mode": "letterbox",
                "training_params": '{"arch": "small_cnn"}',
            },
            None,
        ),
        ({}, None),
    ],
)
def test_a_champions_shape_is_read_from_its_version_tags(tags: dict[str, str], shape: WeightsShape | None) -> None:
    assert shape_from_tags(tags) == shape


def test_weights_of_another_model_are_refused_with_what_to_do() -> None:
    other = ImageModel(5).state_dict()
    with pytest.raises(ValueError, match="warm_start=false"):
        ImageModel(10).load_weights(other)


@pytest.mark.slow
def test_a_warm_started_run_begins_from_the_champions_weights(digits_cached, settings) -> None:
    settings = settings.model_copy(update={"image_size": 24, "max_epochs": 1, "num_workers": 1, "batch_size": 16})
    client = mlflow_client(settings)
    warm_settings = settings.model_copy(update={"warm_start": True})
    nothing_yet = warm_start_of(client, warm_settings, digits_cached)
    assert nothing_yet.version is None and "no champion" in nothing_yet.reason

    first = train_model(digits_cached, settings)
    assert client.get_run(first.mlflow_run_id).data.params["warm_started_from"] == "none"
    promoted, *_ = promote_model(first, digits_cached, settings, None)
    assert promoted.alias == CHAMPION
    champion = load_registered_model(client, settings.model_name, promoted.model_version).state_dict()

    # The champion's version keys the train stage's cache; with warm_start off, nothing about the champion does.
    assert warm_start_key({"cached": digits_cached, "settings": warm_settings}) == {
        "warm start from": promoted.model_version
    }
    assert warm_start_key({"cached": digits_cached, "settings": settings}) == {}
    other_labels = warm_start_of(client, warm_settings, digits_cached.model_copy(update={"labels": list(DIGITS[:9])}))
    assert other_labels.version is None and "labels 10 -> 9" in other_labels.reason

    # A learning rate too small to move the weights: the trained weights are the ones the run started from.
    warm = train_model(digits_cached, warm_settings.model_copy(update={"base_lr": 1e-12}))
    run = client.get_run(warm.mlflow_run_id).data
    assert run.params["warm_started_from"] == promoted.model_version == warm.warm_started_from
    assert "same labels" in run.tags["warm_start_reason"]
    started = torch.load(warm.checkpoint_path, map_location="cpu", weights_only=False)["state_dict"]
    trainable = [name for name, parameter in ImageModel(len(DIGITS)).named_parameters()]
    for name in trainable:
        assert torch.allclose(started[f"model.{name}"], champion[name], atol=1e-6), f"{name} is not the champion's"
