"""Runnable examples of training code a user already has, run on Spark by
``allreduce_param.torch.Distributor``: a PyTorch Lightning ``Trainer`` and a Hugging Face
``transformers.Trainer``. The tests import these same modules (docs/torch.md)."""
