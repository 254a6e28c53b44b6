"""The models: a plain torch classifier over uint8 NHWC images, and the Lightning module that trains it."""

from __future__ import annotations

import io
import math
import os
import pickle
import re
from pathlib import Path
from urllib.error import URLError

import fsspec
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from imagelake.infra.settings import MODEL_ARCHS
from imagelake.infra.weights import (
    WeightsUnavailable,
    cached_of,
    checkpoints_dir,
    is_weights_name,
    missing_message,
    sha256_of,
    verified_file,
)
from imagelake.tasks.worker.augment import augment, epoch_generator


def _conv(in_channels: int, out_channels: int, kernel: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(
            in_channels, out_channels, kernel, stride=stride, padding=(kernel - 1) // 2 if kernel % 2 else 0, bias=False
        ),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class SmallCNN(nn.Module):
    """A small CPU-friendly CNN: a 4x4 patch stem, three strided conv blocks, global pooling."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _conv(3, 32, 4, 4), _conv(32, 64, 3, 2), _conv(64, 128, 3, 2), _conv(128, 256, 3, 2)
        )
        self.head = nn.Linear(256, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


SMALL_CNN = "small_cnn"
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# Builders that take the input size: a vision transformer's position embeddings are made for it.
_SIZED = {"vit_": "image_size"}
# Builders whose auxiliary classifiers would change what a training step returns: built without them.
_NO_AUX = ("googlenet", "inception_v3")


def check_arch(arch: str) -> str:
    if arch not in MODEL_ARCHS:
        raise ValueError(
            f"unknown model_arch {arch!r}: choose small_cnn or one of torchvision.models.list_models() "
            "(resnet50, efficientnet_b0, ...)"
        )
    return arch


def weights_of(arch: str, pretrained: str) -> torchvision.models.WeightsEnum:
    """The torchvision weights `pretrained` names for `arch`: imagenet is the architecture's default (best) weights."""
    if arch == SMALL_CNN:
        raise ValueError(
            f"pretrained={pretrained}: small_cnn has no torchvision weights; choose a torchvision model_arch "
            "(e.g. resnet50) or give a state dict's path"
        )
    family = torchvision.models.get_model_weights(arch)
    name = "DEFAULT" if pretrained == "imagenet" else pretrained
    if "." in name:
        enum, _, name = name.partition(".")
        if enum != family.__name__:
            raise ValueError(
                f"pretrained={pretrained} are weights of another model: {arch}'s are {family.__name__} "
                f"({', '.join(family.__members__)})"
            )
    if name not in family.__members__:
        raise ValueError(
            f"pretrained={pretrained}: {arch} has no such weights; choose imagenet or one of "
            f"{', '.join(family.__members__)}"
        )
    return family[name]


def weights_file(weights: torchvision.models.WeightsEnum) -> str:
    """Where torchvision's cache keeps (or would keep) these weights: $TORCH_HOME/hub/checkpoints/<the URL's file
    name>."""
    return str(checkpoints_dir() / os.path.basename(weights.url))


def weights_setting(arch: str, pretrained: str | None) -> str | None:
    """The torchvision weights `pretrained` names for `arch` in full (MobileNet_V2_Weights.IMAGENET1K_V1), or None when
    it names none (no weights, a state dict's path); unknown names raise as weights_of does."""
    return str(weights_of(arch, pretrained)) if is_weights_name(pretrained) else None


def weights_path(arch: str, weights: torchvision.models.WeightsEnum, pretrained: str) -> Path:
    """The cached file of WEIGHTS, its digest checked; downloaded into the cache first where it is missing and the
    internet is reachable. A missing file names the weights of the same architecture that are cached, if any."""
    file = os.path.basename(weights.url)
    path = checkpoints_dir() / file
    if not path.is_file():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(weights.url, str(path), hash_prefix=None, progress=False)
        except (URLError, OSError) as error:
            others = [entry for entry in cached_of(arch) if entry.file != file]
            instead = (
                f" Weights of {arch} that are in the cache: {', '.join(e.weights for e in others)}; set "
                f"pretrained={others[0].setting} to start from them."
                if others
                else ""
            )
            raise WeightsUnavailable(
                f"{missing_message(file, pretrained, weights.url)} (download: {getattr(error, 'reason', error)})."
                + instead
            ) from None
    return verified_file(file, pretrained, weights.url)


def pretrained_source(arch: str, pretrained: str | None) -> tuple[str, str]:
    """Where a model's weights start, for its lineage: the torchvision weights' full name (or the state dict's path)
    and the SHA-256 of their file ("" for a path), or ("none", "") from scratch. Weights named by torchvision's API
    must be in its cache with their digest (WeightsUnavailable otherwise)."""
    if not pretrained:
        return "none", ""
    if not is_weights_name(pretrained):
        return pretrained, ""
    weights = weights_of(arch, pretrained)
    return str(weights), sha256_of(weights_path(arch, weights, pretrained))


def torchvision_state(path: Path, pretrained: str) -> dict[str, torch.Tensor]:
    """A torchvision weights file as a state dict, loaded as data (never unpickling objects)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError) as error:
        raise WeightsUnavailable(
            f"pretrained={pretrained}: the cached file {path} does not load as a state dict ({error}); delete it "
            "and put the published file there (`make install` for the weights it knows)"
        ) from None
    if not isinstance(state, dict):
        raise WeightsUnavailable(f"pretrained={pretrained}: the cached file {path} is not a state dict")
    return state


# What torchvision's builders change about a model when they are given weights (their own weights' shapes).
def pretrained_options(arch: str, weights: torchvision.models.WeightsEnum, image_size: int | None) -> dict:
    options: dict = {"num_classes": len(weights.meta["categories"])}
    if arch in _NO_AUX:
        options["transform_input"] = True
    if arch.startswith("vit_"):
        trained_at = weights.meta["min_size"][0]
        if image_size and image_size != trained_at:
            raise ValueError(f"image_size={image_size}, but they were trained at {trained_at}")
        options["image_size"] = trained_at
    if arch.startswith("maxvit"):
        options["input_size"] = weights.meta["min_size"]
    return options


# DenseNet's published files name some layers the old way (norm.1 for norm1): the builder's names.
_OLD_DENSENET = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$"
)


def build_net(
    arch: str, num_classes: int, pretrained: str | None = None, image_size: int | None = None
) -> tuple[nn.Module, str]:
    """The network and the name of its classification head (a fresh layer for `num_classes`).

    Torchvision's models are built by its own builder; with weights named by `pretrained`, their file in torchvision's
    cache (downloaded into it when missing and reachable) is checked against its digest and loaded as data, then the
    head is replaced.
    """
    check_arch(arch)
    if arch == SMALL_CNN:
        if is_weights_name(pretrained):
            weights_of(arch, pretrained)  # raises: small_cnn has none
        return SmallCNN(num_classes), "head"
    weights = weights_of(arch, pretrained) if is_weights_name(pretrained) else None
    options: dict = {"aux_logits": False, "init_weights": False} if arch in _NO_AUX else {}
    options.update({key: image_size for prefix, key in _SIZED.items() if arch.startswith(prefix) and image_size})
    if weights is None:
        net = torchvision.models.get_model(arch, **options)
        return net, replace_head(net, num_classes)
    try:
        options.update(pretrained_options(arch, weights, image_size))
    except ValueError as error:
        raise ValueError(
            f"pretrained={pretrained}: {weights} cannot build {arch} here ({error}); set image_size to the "
            "size they were trained at"
        ) from None
    state = torchvision_state(weights_path(arch, weights, pretrained), pretrained)
    if arch.startswith("densenet"):
        state = {_OLD_DENSENET.sub(r"\1\2", name): tensor for name, tensor in state.items()}
    net = torchvision.models.get_model(arch, **options)
    # Auxiliary classifiers are built only when asked for: their weights in the file have nowhere to go.
    state = {name: tensor for name, tensor in state.items() if not name.startswith(("aux", "AuxLogits"))}
    try:
        net.load_state_dict(state)
    except RuntimeError as error:
        raise WeightsUnavailable(
            f"pretrained={pretrained}: {weights_file(weights)} does not fit {arch} ({str(error)[:300]})"
        ) from None
    return net, replace_head(net, num_classes)


def replace_head(net: nn.Module, num_classes: int) -> str:
    """Swap the network's last classification layer (a Linear, or squeezenet's 1x1 Conv2d, with 1000 outputs) for a new
    one with `num_classes`; returns its name."""
    found = [
        (name, module)
        for name, module in net.named_modules()
        if (isinstance(module, nn.Linear) and module.out_features == 1000)
        or (isinstance(module, nn.Conv2d) and module.out_channels == 1000)
    ]
    if not found:
        raise ValueError(f"{type(net).__name__} has no 1000-class layer to replace: not a classification model")
    name, old = found[-1]
    if isinstance(old, nn.Linear):
        new: nn.Module = nn.Linear(old.in_features, num_classes, bias=old.bias is not None)
    else:
        new = nn.Conv2d(
            old.in_channels, num_classes, old.kernel_size, old.stride, old.padding, bias=old.bias is not None
        )
    parent_name, _, leaf = name.rpartition(".")
    setattr(net.get_submodule(parent_name) if parent_name else net, leaf, new)
    return name


def load_state_dict(uri: str, what: str = "pretrained") -> dict[str, torch.Tensor]:
    """A state dict from a local path or any fsspec URI, loaded without unpickling arbitrary objects; `what` names it in
    errors."""
    try:
        with fsspec.open(uri, "rb") as handle:
            state = torch.load(io.BytesIO(handle.read()), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{what} {uri} does not exist: give a local path or URI of a saved state dict, or imagenet for "
            "torchvision's weights"
        ) from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict):
        raise ValueError(f"{what} {uri} is not a state dict (a mapping of parameter names to tensors)")
    return state


class ImageModel(nn.Module):
    """Takes images exactly as the table stores them (N, H, W, 3 uint8) and returns class logits.

    Normalising here, on the model's device, keeps the data path in uint8 and the served model self-contained.
    `pretrained` names torchvision weights (imagenet, IMAGENET1K_V2, ...) or is the path or URI of a state dict.
    """

    def __init__(
        self,
        num_classes: int,
        arch: str = SMALL_CNN,
        pretrained: str | None = None,
        freeze_backbone: bool = False,
        image_size: int | None = None,
    ) -> None:
        super().__init__()
        self.net, self.head_name = build_net(arch, num_classes, pretrained, image_size)
        imagenet = arch != SMALL_CNN
        self.register_buffer(
            "mean", torch.tensor(IMAGENET_MEAN if imagenet else (0.5,) * 3).view(1, 3, 1, 1) * 255, persistent=False
        )
        self.register_buffer(
            "std", torch.tensor(IMAGENET_STD if imagenet else (0.5,) * 3).view(1, 3, 1, 1) * 255, persistent=False
        )
        self.channels_last = False
        if pretrained and not is_weights_name(pretrained):
            self.load_backbone(load_state_dict(pretrained))
        self.frozen = freeze_backbone
        if freeze_backbone:
            for name, parameter in self.net.named_parameters():
                parameter.requires_grad = name.startswith(self.head_prefix)
            # Lightning restores each module's mode around validation and never calls train() before the first epoch:
            # the backbone is put in eval mode here, once.
            self.train()

    @property
    def head_prefix(self) -> str:
        return f"{self.head_name}."

    def load_backbone(self, state: dict[str, torch.Tensor]) -> None:
        """Load every weight whose name and shape match; the classification head stays fresh when the classes differ.

        A state dict of a whole imagelake model (names under `net.`) is taken as its network's.
        """
        if state and all(name.startswith("net.") for name in state):
            state = {name[4:]: tensor for name, tensor in state.items()}
        own = self.net.state_dict()
        backbone = [name for name in own if not name.startswith(self.head_prefix)]
        misfits = [name for name in backbone if name in state and state[name].shape != own[name].shape]
        if misfits:
            raise ValueError(
                f"pretrained weights do not fit this model: {len(misfits)} layers have other shapes (e.g. "
                f"{', '.join(misfits[:3])}); "
                "they are for another model_arch or image_size"
            )
        usable = {name: tensor for name, tensor in state.items() if name in own and own[name].shape == tensor.shape}
        if not any(name in usable for name in backbone):
            raise ValueError(
                "pretrained weights match none of the model's layers: is it a state dict for this model_arch?"
            )
        self.net.load_state_dict(usable, strict=False)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load a whole model's weights (a warm start from the champion): every name and shape must match."""
        own = self.state_dict()
        wrong = sorted(set(own) ^ set(state)) + sorted(
            name for name in own if name in state and own[name].shape != state[name].shape
        )
        if wrong:
            raise ValueError(
                f"the warm start weights do not fit this model ({len(wrong)} mismatched, e.g. "
                f"{', '.join(wrong[:3])}): the champion was trained "
                "for other labels or another model_arch; set warm_start=false to train from scratch"
            )
        self.load_state_dict(state)

    def train(self, mode: bool = True) -> ImageModel:
        super().train(mode)
        if self.frozen:
            # A frozen backbone keeps its batch-norm statistics (and its dropout is off): only the head trains.
            self.net.eval()
            self.net.get_submodule(self.head_name).train(mode)
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = (images.permute(0, 3, 1, 2).float() - self.mean) / self.std
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)


def warmup_cosine(step: int, total_steps: int, warmup_steps: int) -> float:
    """The learning rate's factor at `step`: a linear warm-up to 1, then a cosine down to 0 at `total_steps`.

    A constant 1 when `total_steps` is 0 (a module built without a schedule).
    """
    if total_steps <= 0:
        return 1.0
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compiled(model: nn.Module, mode: str | None) -> nn.Module:
    """`model` through torch.compile in `mode` (one of COMPILE_MODES), or `model` itself for None or "off"."""
    if mode in (None, "", "off"):
        return model
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}: choose off or one of {', '.join(COMPILE_MODES)}")
    # Batches of an epoch have at most two sizes: a graph for each, not one with a symbolic batch dimension.
    return torch.compile(model, mode=mode, dynamic=False)


class ImageClassifier(pl.LightningModule):
    """Lightning module around ImageModel: cross-entropy (label smoothing and class weights in training), AdamW with
    warm-up and cosine decay (a lower rate for a pretrained backbone than for its new head), augmentation of training
    batches, per-epoch loss and accuracy."""

    def __init__(
        self,
        num_classes: int,
        learning_rate: float,
        arch: str = SMALL_CNN,
        pretrained: str | None = None,
        freeze_backbone: bool = False,
        total_steps: int = 0,
        warmup_steps: int = 0,
        compile_mode: str | None = None,
        image_size: int | None = None,
        augment: str = "none",
        augment_flip: bool = False,
        seed: int = 0,
        label_smoothing: float = 0.0,
        class_weights: list[float] | None = None,
        backbone_lr_factor: float = 1.0,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = ImageModel(num_classes, arch, pretrained, freeze_backbone, image_size)
        # Steps run through the compiled module, which shares the model's parameters. It is kept out of the module tree
        # (object.__setattr__), so that state dicts, checkpoints and the exported model hold the plain model's names.
        object.__setattr__(self, "_step_model", compiled(self.model, compile_mode))
        self.register_buffer(
            "class_weights",
            torch.tensor(class_weights, dtype=torch.float32) if class_weights else None,
            persistent=False,
        )
        self._augment_draws: torch.Generator | None = None
        # The splits whose metric objects were handed to self.log in the current epoch (see _step).
        self._logged: set[str] = set()
        # Metric objects sum correct answers and samples across steps and workers: exact epoch figures
        # even when workers' batches differ in size (a mean of per-batch means would not be).
        # Their per-step checks are off: each reads a value back from the GPU and stalls the step (a NaN loss still
        # shows: it makes the epoch's loss NaN, which stops training, where it used to be dropped with a warning).
        self.metrics = nn.ModuleDict(
            {
                f"{split}_{name}": metric
                for split in ("train", "val")
                for name, metric in (
                    ("acc", MulticlassAccuracy(num_classes, average="micro", validate_args=False)),
                    ("loss", MeanMetric(nan_strategy="disable")),
                )
            }
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def on_train_epoch_start(self) -> None:
        # Each epoch's augmentation is drawn from (seed, epoch, rank): a rerun, or a run resumed at this epoch, sees the
        # same images.
        self._augment_draws = epoch_generator(self.hparams.seed, self.current_epoch, self.global_rank)
        self._logged.discard("train")

    def on_validation_epoch_start(self) -> None:
        self._logged.discard("val")

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str) -> torch.Tensor:
        images, labels = batch
        training = prefix == "train"
        if training and self.hparams.augment != "none":
            draws = self._augment_draws or epoch_generator(self.hparams.seed, 0, 0)
            images = augment(images, self.hparams.augment, draws, flip=self.hparams.augment_flip)
        logits = self._step_model(images)
        # What training minimises may be smoothed and weighted; val_loss, which early stopping and checkpoints follow,
        # is plain.
        loss = F.cross_entropy(
            logits,
            labels,
            weight=self.class_weights if training else None,
            label_smoothing=self.hparams.label_smoothing if training else 0.0,
        )
        self.metrics[f"{prefix}_acc"].update(logits.detach(), labels)
        # The batch's loss once per image, a view: the epoch's loss is the mean over images whatever the batch sizes.
        # (A weight would do it, but MeanMetric drops weights when its NaN checks are off, and a Python number as weight
        # is copied to the GPU by a copy that waits for the step to finish: the host could no longer run ahead.)
        self.metrics[f"{prefix}_loss"].update(loss.detach().expand(len(labels)))
        if prefix not in self._logged:
            # Lightning keeps the metric object it is given and computes it at the epoch's end: once an epoch is enough.
            # Each self.log call moves the object to the batch's device and copies its record, about 1 ms of host
            # time per call, which the GPU waits for when the model's step is shorter than the host's.
            self.log(f"{prefix}_loss", self.metrics[f"{prefix}_loss"], on_step=False, on_epoch=True)
            self.log(f"{prefix}_acc", self.metrics[f"{prefix}_acc"], on_step=False, on_epoch=True)
            self._logged.add(prefix)
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self) -> dict:
        head_prefix = f"model.net.{self.model.head_prefix}"
        trainable = [(name, p) for name, p in self.named_parameters() if p.requires_grad]
        head = [p for name, p in trainable if name.startswith(head_prefix)]
        backbone = [p for name, p in trainable if not name.startswith(head_prefix)]
        rate = self.hparams.learning_rate
        groups = [
            group
            for group in (
                {"params": head, "lr": rate},
                {"params": backbone, "lr": rate * self.hparams.backbone_lr_factor},
            )
            if group["params"]
        ]
        # One fused kernel for the whole update on a GPU (the per-tensor loop costs host time at every step).
        fused = bool(trainable) and all(p.is_cuda for _, p in trainable)
        optimizer = torch.optim.AdamW(groups, lr=rate, weight_decay=self.hparams.weight_decay, fused=fused or None)
        total, warmup = self.hparams.total_steps, self.hparams.warmup_steps
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, total, warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
