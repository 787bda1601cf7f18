"""A ``torch.distributed`` backend over the engine: ``init_process_group(backend="allreduce_param")``
inside a process bound to an engine handle gives a process group whose collectives (those
``DistributedDataParallel`` and FSDP use) run on the engine's typed collectives.

Needs torch (the optional extra ``allreduce-param[torch]``); ``import allreduce_param`` never
imports this package. ``backend.py``: ``BACKEND``, ``register``, ``bind``,
``process_group_parameter``; ``process_group.py``: ``AllReduceProcessGroup``;
``tensors.py``: tensors as numpy arrays and back (host copies for CUDA tensors).
See docs/torch.md.
"""

from allreduce_param.torch_backend.backend import BACKEND, bind, process_group_parameter, register
from allreduce_param.torch_backend.process_group import AllReduceProcessGroup

__all__ = ["BACKEND", "AllReduceProcessGroup", "bind", "process_group_parameter", "register"]
