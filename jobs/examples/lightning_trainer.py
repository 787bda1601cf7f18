"""A PyTorch Lightning ``Trainer`` with DDP, run on Spark by the Distributor: the ranks'
gradients are averaged by this project's torch.distributed backend instead of gloo.

Nothing here is special to Spark but where the ranks come from: the Distributor sets
torchrun's environment in each rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``...), so Lightning takes its ranks from it (its
``TorchElasticEnvironment``) and starts no processes of its own, and it finds the default
process group made, on the engine's backend, and uses it. ``devices`` and ``num_nodes``
must multiply to the number of ranks, as Lightning checks: the ranks on this host, and the
hosts (every host must run as many ranks: Lightning's DDP has one number of devices).

Needs the ``lightning`` extra (``pip install -e '.[lightning]'``). Runs on a local
session::

    python jobs/examples/lightning_trainer.py
"""

from __future__ import annotations

import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    """A small MLP fitting a smooth function of 8 inputs, by SGD with momentum; its epoch's
    mean loss is logged as ``loss``, averaged over the ranks (``sync_dist``)."""

    def __init__(self, learning_rate: float = 0.05) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate, momentum=0.9)


def rows(count: int = 64) -> TensorDataset:
    """Generated training rows, the same on every rank (Lightning gives each rank its share
    through a ``DistributedSampler``): 8 normal inputs, the sine of their sum."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(count, 8, generator=generator)
    return TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))


def train(epochs: int = 3, batch_size: int = 8) -> dict:
    """The training function each rank runs: a Lightning ``Trainer`` with DDP on the CPU.
    Returns the trained weights, the last epoch's mean loss over all ranks, and the world
    size Lightning saw (the Distributor returns rank 0's)."""
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the ranks on this host
    num_nodes = int(os.environ.get("WORLD_SIZE", "1")) // devices
    torch.manual_seed(0)  # every rank starts from the same weights (DDP also sends rank 0's)
    model = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy="ddp",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(rows(), batch_size=batch_size))
    return {
        "weights": {name: value.numpy().copy() for name, value in model.state_dict().items()},
        "loss": float(trainer.callback_metrics["loss"]),
        "world_size": trainer.world_size,
    }


def main() -> None:
    """Train on 2 ranks of a local session and print what rank 0 returned."""
    from allreduce_param.spark.session import local_spark
    from allreduce_param.torch import Distributor

    spark = local_spark("local[2]")
    try:
        result = Distributor(num_processes=2).run(train)
    finally:
        spark.stop()
    print(f"{result['world_size']} ranks; last epoch's mean loss {result['loss']:.5f}")


if __name__ == "__main__":
    main()
