"""Sharded optimizers, learning-rate schedules and gradient clipping for the trainer.

Each of the N partitions owns a contiguous slice of the flattened float32 parameter vector
and runs the optimizer on that slice only; the optimizer's state (momentum buffers, Adam's
moments...) lives beside the slice, so every partition holds 1/N of it. That works because
every optimizer here is a pure *elementwise* update of (weights, gradient, state): element
i of the result depends only on element i of the inputs and on scalars shared by all
partitions (the learning rate, the step, the clipping factor). Applying it slice by slice
therefore gives, bit for bit, what applying it to the whole vector gives: every element
sees the same float32 operations in the same order (numpy's add, multiply, divide, sqrt and
maximum are correctly rounded IEEE operations whether a SIMD or a scalar loop runs them).

The update rules are PyTorch's (``torch.optim``), element for element, with the same
state names; see each class. ``step`` is 0-based here; PyTorch's step count is ``step + 1``.

Cost. ``Optimizer.step`` runs every training step over millions of elements, so it walks the
slice in cache-sized pieces of ``PIECE`` elements, with a few preallocated per-thread
temporaries of that size, and uses only ``out=`` and in-place numpy operations: it allocates
nothing proportional to the slice, and each piece stays in cache between the several passes
an update makes over it. All scalars are Python floats, so numpy (2.x, NEP 50) computes in
float32 throughout.

Schedules (``StepLR``, ``CosineLR``, ``LinearWarmup``) give a factor of the base learning
rate as a pure function of the step, so every partition computes the same learning rate
without talking. Clipping by the *global* norm needs one scalar allreduce: each partition
computes ``squared_norm`` of its gradient slice, the trainer sums them across partitions and
scales every slice by ``clip_scale(total, optimizer.clip_norm)`` (or passes that factor as
``step(..., grad_scale=...)``, which saves a pass over the gradient).

Regularisation as MLlib's (``regParam``, ``elasticNetParam``) is ``ElasticNet``, given to
``Optimizer.step(..., penalty=..., penalized=...)``: its L2 part joins the gradient, its L1
part is a proximal step after the update, both element by element on the slice, so the
sharded result is still one process's (see ``optim.penalty``).

Optimizers and schedules are small picklable configurations made on the driver; they hold
no arrays. Settings are checked when they are made: a wrong one raises
``ConfigurationError`` (a ``ValueError``) naming the setting and its allowed range.
"""

from __future__ import annotations

from allreduce_param.optim.base import Optimizer
from allreduce_param.optim.clipping import clip_scale, squared_norm
from allreduce_param.optim.penalty import ElasticNet
from allreduce_param.optim.rules import SGD, Adagrad, Adam, AdamW, RMSprop
from allreduce_param.optim.schedules import CosineLR, LinearWarmup, Schedule, StepLR

__all__ = [
    "Optimizer",
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "RMSprop",
    "Schedule",
    "StepLR",
    "CosineLR",
    "LinearWarmup",
    "ElasticNet",
    "clip_scale",
    "squared_norm",
]
