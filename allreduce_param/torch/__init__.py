"""Your own PyTorch training loop on Spark: ``Distributor`` runs a function on N ranks,
each a task of one barrier stage, with ``torch.distributed``'s default group on this
project's backend. Importing this package does not import torch; making a
``Distributor`` without torch installed says so."""

from allreduce_param.torch.distributor import Distributor

__all__ = ["Distributor"]
