"""Reference models on scikit-learn's digits (1,797 8x8 images, shipped with the package):
a small CNN (18,346 parameters) and a 4-layer MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.errors import require
from stalwart.models.base import ReferenceModel, register

__all__ = ["DigitsCNN", "MLP", "digits_data"]


class DigitsCNN(nn.Module):
    """conv 1->8 (3x3), conv 8->16 (3x3), fc 256->64, fc 64->10, ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3)
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.fc1 = nn.Linear(256, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


class MLP(nn.Module):
    """Four Linear layers with ReLU: in -> width -> width -> width -> classes."""

    def __init__(self, inputs: int = 64, width: int = 512, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, width)
        self.fc4 = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc2(x))
        x = F.relu(self.fc3(x))
        return self.fc4(x)


def digits_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train/test images (N, 1, 8, 8) in [0, 1] and labels; 1,437 / 360, fixed split."""
    require("sklearn", "sdc", "the digits reference models")
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[:1437], y[:1437], x[1437:], y[1437:]


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(64):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()


def _on_digits(
    name: str, model: nn.Module, train: bool, *, epochs: int, lr: float, flat: bool = False
) -> ReferenceModel:
    """``model`` trained on the digits (unless ``train`` is False), with the test split;
    ``flat``: each 8x8 image as 64 features."""
    xtr, ytr, xte, yte = digits_data()
    if flat:
        xtr, xte = xtr.flatten(1), xte.flatten(1)
    if train:
        _train(model, xtr, ytr, epochs=epochs, lr=lr)
    return ReferenceModel(name, model.eval(), (xte,), yte, ("top1", "top5"), "accuracy")


@register("digits-cnn")
def digits_cnn(train: bool = True) -> ReferenceModel:
    """The digits CNN, about 96 % test accuracy after 30 epochs (~3 s on one core)."""
    torch.manual_seed(0)
    return _on_digits("digits-cnn", DigitsCNN(), train, epochs=30, lr=3e-3)


@register("mlp")
def mlp(train: bool = True) -> ReferenceModel:
    """A 4-layer MLP (64->512->512->512->10, 560k parameters) on the digits."""
    torch.manual_seed(0)
    return _on_digits("mlp", MLP(), train, epochs=8, lr=1e-3, flat=True)
