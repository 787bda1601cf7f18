"""A Hugging Face ``transformers.Trainer``, run on Spark by the Distributor: the ranks'
gradients are averaged by this project's torch.distributed backend instead of gloo.

``Trainer`` (through Accelerate) sees torchrun's environment, which the Distributor sets
in each rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``...), finds the default process group
made, on the engine's backend, and wraps the model in ``DistributedDataParallel`` over it;
``use_cpu=True`` keeps it on the CPU. Leave ``ddp_backend`` unset: it names the group
Accelerate would make, and the group is made already.

The model is a tiny Llama made from a config (a few thousand weights, nothing downloaded),
learning to continue made-up counting sequences. Needs the ``huggingface`` extra
(``pip install -e '.[huggingface]'``). Runs on a local session::

    python jobs/examples/huggingface_trainer.py
"""

from __future__ import annotations

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

#: the tiny model's vocabulary and sequence length
VOCABULARY, LENGTH = 32, 8


def tiny_llama() -> LlamaForCausalLM:
    """A 2-layer Llama made from a config with fixed initial weights (no dropout, no
    biases)."""
    config = LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def sequences(count: int = 64) -> list[dict[str, torch.Tensor]]:
    """Made-up rows, the same on every rank (the Trainer gives each rank its own batches):
    counting sequences (each token the one before plus 1, modulo the vocabulary) from random
    starts; the labels are the tokens, which the model predicts one ahead."""
    generator = torch.Generator().manual_seed(11)
    starts = torch.randint(0, VOCABULARY, (count, 1), generator=generator)
    tokens = (starts + torch.arange(LENGTH)) % VOCABULARY
    return [
        {"input_ids": row, "attention_mask": torch.ones(LENGTH, dtype=torch.long), "labels": row}
        for row in tokens
    ]


def train(output_dir: str, steps: int = 6, batch_size: int = 4) -> dict:
    """The training function each rank runs: ``Trainer.train`` for ``steps`` optimizer steps
    of ``batch_size`` rows per rank (the rows shuffled by the Trainer's seeded sampler, the
    same order on every rank, which takes every world-size-th batch of it), no checkpoints
    in ``output_dir``. Returns the logged losses (each step's mean
    over all ranks' rows), the trained weights, and the world size the Trainer saw (the
    Distributor returns rank 0's)."""
    arguments = TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=batch_size,
        max_steps=steps,
        learning_rate=2e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    model = tiny_llama()
    trainer = Trainer(model=model, args=arguments, train_dataset=sequences())
    trainer.train()
    return {
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "weights": {name: value.numpy().copy() for name, value in model.state_dict().items()},
        "world_size": arguments.world_size,
    }


def main() -> None:
    """Train on 2 ranks of a local session and print what rank 0 returned."""
    from allreduce_param.spark.session import local_spark
    from allreduce_param.torch import Distributor

    spark = local_spark("local[2]")
    try:
        with tempfile.TemporaryDirectory() as output_dir:
            result = Distributor(num_processes=2).run(train, output_dir)
    finally:
        spark.stop()
    print(f"{result['world_size']} ranks; losses {[round(loss, 4) for loss in result['losses']]}")


if __name__ == "__main__":
    main()
