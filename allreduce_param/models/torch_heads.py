"""A ``TorchModel``'s loss head: the module's output against the labels, summed over the
rows, and the predictions it gives; the torch twins of ``models.losses``."""

from __future__ import annotations

from typing import Any

import numpy as np

from allreduce_param.errors import ConfigurationError
from allreduce_param.models.torch_state import require_torch

LOSSES = ("cross_entropy", "mse")


class TorchHead:
    """``"cross_entropy"`` (classification: the module outputs class scores) or ``"mse"``
    (regression: 0.5 * squared error, as the built-in models)."""

    def __init__(self, loss: str) -> None:
        if loss not in LOSSES:
            raise ConfigurationError(f"TorchModel(loss={loss!r}): loss must be one of {LOSSES}")
        self.loss = loss
        self.task = "classification" if loss == "cross_entropy" else "regression"

    def loss_sum(self, output: Any, y: np.ndarray) -> Any:
        """The summed loss of ``output`` against the labels ``y`` (a torch scalar)."""
        torch = require_torch()
        if self.loss == "cross_entropy":
            return torch.nn.functional.cross_entropy(
                output, torch.from_numpy(np.asarray(y, np.int64)).to(output.device), reduction="sum"
            )
        target = torch.from_numpy(np.asarray(y, np.float32)).to(output.device).reshape(output.shape)
        return 0.5 * torch.sum((output - target) ** 2)

    def predictions(self, output: Any, rows: int) -> np.ndarray:
        """Class ids (int64) or values (float32) from the module's output."""
        output = output.cpu()
        if self.task == "classification":
            return output.argmax(dim=1).numpy().astype(np.int64)
        return (
            output.reshape(rows, -1).squeeze(1).numpy().astype(np.float32)
            if output.shape[-1] == 1
            else output.numpy().astype(np.float32)
        )
