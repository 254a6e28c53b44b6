"""The models: a plain torch classifier over uint8 NHWC images, and the Lightning module that trains it."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn


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


class ImageModel(nn.Module):
    """Takes images exactly as the table stores them (N, H, W, 3 uint8) and returns class logits.

    Normalising here, on the model's device, keeps the data path in uint8 and the served model self-contained.
    """

    def __init__(self, num_classes: int, arch: str = "small_cnn") -> None:
        super().__init__()
        if arch != "small_cnn":
            raise ValueError(f"unknown model_arch {arch!r}: choose small_cnn")
        self.net = SmallCNN(num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
        return self.net(x)


class ImageClassifier(pl.LightningModule):
    """Lightning module around ImageModel: cross-entropy, AdamW, per-epoch loss and accuracy."""

    def __init__(self, num_classes: int, learning_rate: float, arch: str = "small_cnn") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = ImageModel(num_classes, arch)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str) -> torch.Tensor:
        images, labels = batch
        logits = self.model(images)
        loss = F.cross_entropy(logits, labels)
        accuracy = (logits.argmax(dim=1) == labels).float().mean()
        self.log(f"{prefix}_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log(f"{prefix}_acc", accuracy, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)
