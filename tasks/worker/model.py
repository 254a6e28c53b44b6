"""The models: a plain torch classifier over uint8 NHWC images, and the Lightning module that trains it."""

from __future__ import annotations

import io
import math

import fsspec
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy


def _conv(in_channels: int, out_channels: int, kernel: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=(kernel - 1) // 2 if kernel % 2 else 0, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class SmallCNN(nn.Module):
    """A small CPU-friendly CNN: a 4x4 patch stem, three strided conv blocks, global pooling."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(_conv(3, 32, 4, 4), _conv(32, 64, 3, 2), _conv(64, 128, 3, 2), _conv(128, 256, 3, 2))
        self.head = nn.Linear(256, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class Block(nn.Module):
    """A ResNet basic block (two 3x3 convolutions) or bottleneck (1x1, 3x3, 1x1) with its shortcut."""

    def __init__(self, in_channels: int, width: int, stride: int, bottleneck: bool) -> None:
        super().__init__()
        out_channels = width * (4 if bottleneck else 1)
        self.bottleneck = bottleneck
        if bottleneck:
            self.conv1, self.bn1 = nn.Conv2d(in_channels, width, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
            self.conv3, self.bn3 = nn.Conv2d(width, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels)
        else:
            self.conv1, self.bn1 = nn.Conv2d(in_channels, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2, self.bn2 = nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.bottleneck:
            out = self.bn3(self.conv3(self.relu(out)))
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    """ResNet-18 or ResNet-50. Parameter names follow the common layout (conv1, layer1..4, fc), so
    ImageNet state dicts saved from other implementations load into it."""

    LAYOUTS = {"resnet18": ((2, 2, 2, 2), False), "resnet50": ((3, 4, 6, 3), True)}

    def __init__(self, arch: str, num_classes: int) -> None:
        super().__init__()
        depths, bottleneck = self.LAYOUTS[arch]
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        self.relu, self.maxpool = nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        channels, layers = 64, []
        for index, (depth, width) in enumerate(zip(depths, (64, 128, 256, 512))):
            blocks = []
            for position in range(depth):
                blocks.append(Block(channels, width, 2 if position == 0 and index > 0 else 1, bottleneck))
                channels = width * (4 if bottleneck else 1)
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


ARCHS = ("small_cnn", "resnet18", "resnet50")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def load_state_dict(uri: str, what: str = "pretrained_weights") -> dict[str, torch.Tensor]:
    """A state dict from a local path or any fsspec URI, loaded without unpickling arbitrary objects; `what` names it in errors."""
    try:
        with fsspec.open(uri, "rb") as handle:
            state = torch.load(io.BytesIO(handle.read()), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {uri} does not exist: give a local path or URI of a saved state dict") from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict):
        raise ValueError(f"{what} {uri} is not a state dict (a mapping of parameter names to tensors)")
    return state


class ImageModel(nn.Module):
    """Takes images exactly as the table stores them (N, H, W, 3 uint8) and returns class logits.

    Normalising here, on the model's device, keeps the data path in uint8 and the served model self-contained.
    """

    def __init__(self, num_classes: int, arch: str = "small_cnn", pretrained_weights: str | None = None, freeze_backbone: bool = False) -> None:
        super().__init__()
        if arch not in ARCHS:
            raise ValueError(f"unknown model_arch {arch!r}: choose one of {', '.join(ARCHS)}")
        self.net = SmallCNN(num_classes) if arch == "small_cnn" else ResNet(arch, num_classes)
        imagenet = arch != "small_cnn"
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN if imagenet else (0.5,) * 3).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD if imagenet else (0.5,) * 3).view(1, 3, 1, 1) * 255, persistent=False)
        self.channels_last = False
        if pretrained_weights:
            self.load_backbone(load_state_dict(pretrained_weights))
        self.frozen = freeze_backbone
        if freeze_backbone:
            for name, parameter in self.net.named_parameters():
                parameter.requires_grad = name.startswith(self.head_prefix)

    @property
    def head_prefix(self) -> str:
        return "head." if isinstance(self.net, SmallCNN) else "fc."

    def load_backbone(self, state: dict[str, torch.Tensor]) -> None:
        """Load every weight whose name and shape match; the classification head stays fresh when the classes differ."""
        own = self.net.state_dict()
        usable = {name: tensor for name, tensor in state.items() if name in own and own[name].shape == tensor.shape}
        backbone = [name for name in own if not name.startswith(self.head_prefix)]
        if not any(name in usable for name in backbone):
            raise ValueError("pretrained_weights matches none of the model's layers: is it a state dict for this model_arch?")
        self.net.load_state_dict(usable, strict=False)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load a whole model's weights (a warm start from the champion): every name and shape must match."""
        own = self.state_dict()
        wrong = sorted(set(own) ^ set(state)) + sorted(name for name in own if name in state and own[name].shape != state[name].shape)
        if wrong:
            raise ValueError(
                f"the warm start weights do not fit this model ({len(wrong)} mismatched, e.g. {', '.join(wrong[:3])}): the champion was trained "
                "for other labels or another model_arch; set warm_start=false to train from scratch"
            )
        self.load_state_dict(state)

    def train(self, mode: bool = True) -> "ImageModel":
        super().train(mode)
        if self.frozen:
            # A frozen backbone keeps its batch-norm statistics too.
            for name, module in self.net.named_children():
                if not f"{name}.".startswith(self.head_prefix):
                    module.eval()
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
    """Lightning module around ImageModel: cross-entropy, AdamW with warm-up and cosine decay, per-epoch loss and accuracy."""

    def __init__(
        self,
        num_classes: int,
        learning_rate: float,
        arch: str = "small_cnn",
        pretrained_weights: str | None = None,
        freeze_backbone: bool = False,
        total_steps: int = 0,
        warmup_steps: int = 0,
        compile_mode: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = ImageModel(num_classes, arch, pretrained_weights, freeze_backbone)
        # Steps run through the compiled module, which shares the model's parameters. It is kept out of the module tree
        # (object.__setattr__), so that state dicts, checkpoints and the exported model hold the plain model's names.
        object.__setattr__(self, "_step_model", compiled(self.model, compile_mode))
        # Metric objects sum correct answers and samples across steps and workers: exact epoch figures
        # even when workers' batches differ in size (a mean of per-batch means would not be).
        # Their per-step checks are off: each reads a value back from the GPU and stalls the step (a NaN loss still
        # shows: it makes the epoch's loss NaN, which stops training, where it used to be dropped with a warning).
        self.metrics = nn.ModuleDict(
            {
                f"{split}_{name}": metric
                for split in ("train", "val")
                for name, metric in (("acc", MulticlassAccuracy(num_classes, average="micro", validate_args=False)), ("loss", MeanMetric(nan_strategy="disable")))
            }
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str) -> torch.Tensor:
        images, labels = batch
        logits = self._step_model(images)
        loss = F.cross_entropy(logits, labels)
        self.metrics[f"{prefix}_acc"].update(logits.detach(), labels)
        self.metrics[f"{prefix}_loss"].update(loss.detach(), weight=len(labels))
        self.log(f"{prefix}_loss", self.metrics[f"{prefix}_loss"], on_step=False, on_epoch=True)
        self.log(f"{prefix}_acc", self.metrics[f"{prefix}_acc"], on_step=False, on_epoch=True)
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self) -> dict:
        parameters = [p for p in self.parameters() if p.requires_grad]
        # One fused kernel for the whole update on a GPU (the per-tensor loop costs host time at every step).
        fused = bool(parameters) and all(p.is_cuda for p in parameters)
        optimizer = torch.optim.AdamW(parameters, lr=self.hparams.learning_rate, fused=fused or None)
        total, warmup = self.hparams.total_steps, self.hparams.warmup_steps
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, total, warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
