"""Whether a fit's steps put only the elements their rows touch (``FitSettings.sparse_sync``).

A step on sparse rows touches the first layer's rows of the columns it holds, and every
layer after it; the rest of its gradient is zero. The engine can sync those elements alone
(``put_gradients(SparseGradient)``, ``engine/movement/touched.py``), each owner summing them
into its dense slice with the dense sync's bits, so the optimizer, the weights and the
regularisation are what they would be: the fit's weights are the same bits either way.

It can where the model computes such a gradient (``loss_and_touched_grad``), the rows are
CSR, the strategy is plain BSP with a lossless gradient codec and a flat topology, and a
batch is computed on one thread. ``'auto'`` then chooses it where the first layer is wide
(``TOUCHED_FROM_FEATURES``): there the dense sync's passes over the model are most of a step;
on a narrow one a step is milliseconds either way (docs/performance.md, "Sparse features").
"""

from __future__ import annotations

from allreduce_param.engine.blocks.codec import get_codec
from allreduce_param.engine.parameter import ConnectedParameter
from allreduce_param.errors import ConfigurationError
from allreduce_param.models.base import optional_call, takes_sparse
from allreduce_param.train.settings import workload_shares
from allreduce_param.train.task.job import TrainingJob

#: ``sparse_sync='auto'`` syncs the touched elements from this many features on (the first
#: layer's rows): at 2^22 and 2^24 a click-log step's compute, put and aggregate took a
#: third of the dense sync's, at 2^20 the same (docs/performance.md, "Sparse features").
TOUCHED_FROM_FEATURES = 2**22


def why_not_touched(job: TrainingJob, hierarchical: bool = False) -> str | None:
    """Why this fit cannot sync only the touched elements, or None when it can (where its
    partitions sum ``hierarchical``ly or not: known in a task, assumed flat on the driver)."""
    model = job.model
    if not job.sparse:
        return "the rows are dense (the driver found the features column dense)"
    computes = optional_call(
        model, "loss_and_touched_grad", ("loss_and_grad", "loss_and_grad_into")
    )
    if not takes_sparse(model) or computes is None:
        return f"the model {type(model).__name__} computes no loss_and_touched_grad"
    if not job.param.strategy.inline_owner or job.local_sgd:
        return "it needs plain BSP (no ssp, asp, backup workers or sync_every)"
    if get_codec(job.param.gradient_codec).lossy:
        return f"the gradient codec {job.param.gradient_codec!r} is lossy"
    if len(workload_shares(job.settings.threads)) > 1:
        return "its batches are split over threads (threads=)"
    if hierarchical:
        return "its hosts sum within themselves first: set topology='flat'"
    return None


def check_touched(job: TrainingJob, hierarchical: bool = False) -> None:
    """Refuse ``sparse_sync='touched'`` where it cannot serve, with a ``ConfigurationError``
    saying why: on the driver before the stage, and in a task (which knows its hosts)."""
    reason = why_not_touched(job, hierarchical) if job.settings.sparse_sync == "touched" else None
    if reason is not None:
        raise ConfigurationError(
            f"sparse_sync='touched' cannot serve this fit: {reason}; use sparse_sync='auto' or "
            "'dense'"
        )


def uses_touched_sync(job: TrainingJob, p: ConnectedParameter) -> bool:
    """Whether the steps put a ``SparseGradient``: ``sparse_sync`` 'touched' (refused where it
    cannot be, ``check_touched``), 'dense', or 'auto' (where it can and the first layer has
    at least ``TOUCHED_FROM_FEATURES`` rows)."""
    choice = job.settings.sparse_sync
    if choice == "dense":
        return False
    check_touched(job, p.info.hierarchical)
    return why_not_touched(job, p.info.hierarchical) is None and (
        choice == "touched" or job.n_features >= TOUCHED_FROM_FEATURES
    )
