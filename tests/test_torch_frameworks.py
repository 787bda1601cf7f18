"""Training code written for PyTorch Lightning and Hugging Face ``transformers``, run by the
Distributor as a user would run it (jobs/examples/, the same modules the docs show): each
framework finds the ranks in torchrun's environment and the default group on this project's
backend, and trains as it would on gloo: the same weights as one process on the whole batch,
to float32 summation-order rounding. Each framework's test skips where its package is not
installed (the ``lightning`` and ``huggingface`` extras; .ci/run installs both)."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

pytest.importorskip("torch")

from pyspark import cloudpickle  # noqa: E402

from allreduce_param.torch import Distributor  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _missing(*packages: str) -> bool:
    """Whether any of ``packages`` is not installed (checked before the Spark session starts)."""
    return any(importlib.util.find_spec(package) is None for package in packages)


def _examples(name: str):
    """An example module of jobs/examples/, pickled by value, as Spark's tasks cannot import
    jobs/."""
    example = importlib.import_module(f"examples.{name}")
    cloudpickle.register_pickle_by_value(example)
    return example


def _each_rank_kept(train_fn, folder: str):
    """``train_fn`` as each rank runs it: its weights written to ``folder`` (``rank-N.npz``,
    read back by the test, as the Distributor returns rank 0's value alone), its result
    with the backend its group ran on."""

    def rank(*args) -> dict:
        import os

        import torch.distributed as dist

        result = train_fn(*args)
        np.savez(os.path.join(folder, f"rank-{dist.get_rank()}.npz"), **result["weights"])
        return {**result, "backend": dist.get_backend()}

    return rank


def _assert_ranks_agree(folder, world: int = 2) -> None:
    """Every rank ended with the same weights, bit for bit (DDP's invariant)."""
    kept = [np.load(folder / f"rank-{rank}.npz") for rank in range(world)]
    assert kept[0].files
    for name in kept[0].files:
        for other in kept[1:]:
            assert np.array_equal(kept[0][name], other[name]), name


def _both_ranks_batches(rows, epochs: int, batch_size: int, world: int = 2) -> list[list[int]]:
    """The rows of each DDP step over all ranks: Lightning gives rank r the rows of a
    shuffling ``DistributedSampler`` (seed 0, reshuffled each epoch), batch by batch."""
    from torch.utils.data import DistributedSampler

    batches = []
    for epoch in range(epochs):
        shares = []
        for rank in range(world):
            sampler = DistributedSampler(rows, num_replicas=world, rank=rank, seed=0)
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
        for start in range(0, len(shares[0]), batch_size):
            batches.append([row for share in shares for row in share[start : start + batch_size]])
    return batches


@pytest.mark.slow
@pytest.mark.skipif(_missing("lightning"), reason="the lightning extra is not installed")
def test_a_lightning_trainer_with_ddp_trains_as_one_process_on_the_whole_batch(spark, tmp_path):
    example = _examples("lightning_trainer")
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    epochs, batch_size = 3, 8
    train = _each_rank_kept(example.train, str(tmp_path))
    result = Distributor(num_processes=2).run(train, epochs, batch_size)
    assert result["world_size"] == 2 and result["backend"] == "allreduce_param"
    _assert_ranks_agree(tmp_path)

    # one process, each step on both ranks' rows of that step, in one batch
    rows = example.rows()
    batches = _both_ranks_batches(rows, epochs, batch_size)
    step_losses: list[float] = []

    class StepLosses(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            step_losses.append(float(outputs["loss"]))

    torch.manual_seed(0)
    model = example.Regressor()
    L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,  # the epochs' batches in one list: the optimizer's state goes on as in 3
        callbacks=[StepLosses()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(model, DataLoader(rows, batch_sampler=batches))
    reference = model.state_dict()
    assert result["weights"].keys() == reference.keys()
    for name, ours in result["weights"].items():
        np.testing.assert_allclose(ours, reference[name].numpy(), rtol=1e-5, atol=1e-6)
    # the last epoch's loss, each rank's mean averaged over the ranks (sync_dist)
    last_epoch = step_losses[-len(batches) // epochs :]
    assert result["loss"] == pytest.approx(np.mean(last_epoch), rel=1e-5)
    assert np.mean(last_epoch) < np.mean(step_losses[: len(batches) // epochs])


@pytest.mark.slow
@pytest.mark.skipif(
    _missing("transformers", "accelerate"), reason="the huggingface extra is not installed"
)
def test_a_transformers_trainer_trains_as_one_process_on_the_whole_batch(
    spark, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the model is made from a config: nothing to fetch
    example = _examples("huggingface_trainer")

    steps, batch_size = 6, 4
    train = _each_rank_kept(example.train, str(tmp_path))
    result = Distributor(num_processes=2).run(train, str(tmp_path / "ranks"), steps, batch_size)
    assert result["world_size"] == 2 and result["backend"] == "allreduce_param"
    _assert_ranks_agree(tmp_path)
    assert result["losses"][-1] < result["losses"][0]

    # one process, each step on both ranks' rows: the Trainer shuffles the rows by its seed,
    # the same on every rank, and hands the ranks its batches in turn (rank 0 the first,
    # rank 1 the second...)
    reference = example.train(str(tmp_path / "one"), steps, 2 * batch_size)
    np.testing.assert_allclose(result["losses"], reference["losses"], rtol=1e-5)
    for name, ours in result["weights"].items():
        np.testing.assert_allclose(ours, reference["weights"][name], rtol=1e-4, atol=1e-6)
