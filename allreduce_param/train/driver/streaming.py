"""Training on a streaming DataFrame: each micro-batch a fit that continues the last one.

``DistriOptimizer.fit_stream`` starts a streaming query whose ``foreachBatch`` function is
a ``StreamFit``: on the driver, for each micro-batch, one fit (one barrier stage) from the
previous micro-batch's model (``fit(initial=...)``, so the epochs and the optimizer's
steps go on), then the result published (``train.publish``: the folder's ``LATEST.json``
always names a complete model) and handed to ``on_model``.

Exactly once, across restarts: Spark's query checkpoint replays, after a restart, the
micro-batches it had not recorded as done, with their batch ids; the published pointer
holds the id of the last micro-batch trained. So a restarted ``StreamFit`` starts from the
published model and skips every batch id at or below it (trained already, its model
published before Spark could record the batch done), and trains every later one. A
micro-batch with no rows (a rate source's first, a quiet topic's) trains nothing and is
passed over with a warning, or with ``empty_batches="error"`` stops the query. The
pointer also names the query checkpoint its batch ids belong to: another query's ids
would mean nothing, and are refused.
"""

from __future__ import annotations

import copy
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

from allreduce_param.errors import InputError
from allreduce_param.models.saving import saves_as_data
from allreduce_param.models.torch_module import TorchModel
from allreduce_param.train.driver.checks import check_initial
from allreduce_param.train.publish import PublishedModels, columns_of, query_id_of
from allreduce_param.train.storage import scheme_of

log = logging.getLogger(__name__)


def start_query(
    trainer: Any,
    stream: Any,
    model_path: Any,
    checkpoint_location: Any,
    fit_arguments: dict[str, Any],
    initial: Any,
    on_model: Callable[[int, Any], None] | None,
    trigger: dict[str, Any] | None,
    query_name: str | None,
    empty_batches: str = "skip",
    allow_pickle: bool = False,
) -> Any:
    """``DistriOptimizer.fit_stream``: its arguments checked before the query starts, then
    the query, with a ``StreamFit`` of ``trainer`` (the ``DistriOptimizer``) as its
    ``foreachBatch`` function; the ``StreamingQuery``."""
    if not getattr(stream, "isStreaming", False):
        raise InputError(
            "fit_stream takes a streaming DataFrame (spark.readStream...); for a static one, "
            "use fit()"
        )
    if trigger is not None and not isinstance(trigger, dict):
        raise InputError(
            "trigger must be DataStreamWriter.trigger's keyword arguments as a dict, e.g. "
            f"{{'availableNow': True}}, got {trigger!r}"
        )
    checkpoint = query_checkpoint_name(checkpoint_location)
    check_empty_batches(empty_batches)
    if not allow_pickle and not saves_as_data(trainer.model):
        raise InputError(
            f"fit_stream publishes each micro-batch's model to model_path without pickle, and "
            f"{trainer.model!r} is not one of the built-in models or a TorchModel, so it saves "
            "only as a pickle (which runs code when it is loaded): pass allow_pickle=True to "
            "fit_stream to publish it so, for a model_path no one else can write to"
        )
    if initial is not None:
        initial = check_initial(initial, trainer.model, trainer.optimizer, trainer.settings)
    names = [fit_arguments[key] for key in ("features_col", "label_col", "weight_col")]
    batch_fit = StreamFit(
        trainer.fit,
        PublishedModels(model_path, allow_pickle),
        checkpoint,
        [name for name in names if name is not None],
        fit_arguments,
        initial,
        on_model,
        empty_batches,
        module=copy.deepcopy(trainer.model.module)
        if isinstance(trainer.model, TorchModel)
        else None,
    )
    batch_fit.published.claim(checkpoint)  # before the query starts: this query's folder
    writer = stream.writeStream.foreachBatch(batch_fit).option("checkpointLocation", checkpoint)
    if trigger is not None:
        writer = writer.trigger(**trigger)
    if query_name is not None:
        writer = writer.queryName(query_name)
    return writer.start()


def check_empty_batches(value: Any) -> str:
    """``empty_batches``: ``"skip"`` or ``"error"``."""
    if value not in ("skip", "error"):
        raise InputError(
            f"empty_batches must be 'skip' (pass over a micro-batch with no rows, as a rate "
            f"source's first) or 'error' (stop the query), got {value!r}"
        )
    return value


def query_checkpoint_name(location: Any) -> str:
    """The streaming query's checkpoint as the pointer records it: a local path made
    absolute (a restart from another working directory names the same folder)."""
    if location is None or not str(location):
        raise InputError(
            "fit_stream needs checkpoint_location, the streaming query's checkpoint folder: "
            "without it a restarted query would number its micro-batches from 0 again, and "
            "the published model could not say which ones it has trained on"
        )
    text = os.fspath(location)
    return text if scheme_of(text) else os.path.abspath(text)


class StreamFit:
    """The ``foreachBatch`` function of a streaming fit, and what it keeps between
    micro-batches: the newest model and the id of the micro-batch it trained last.
    ``module``: for a ``TorchModel``'s fit, a copy of its module, which the published model
    found at the start is loaded into (a saved model holds no code)."""

    def __init__(
        self,
        fit: Callable[..., Any],
        published: PublishedModels,
        query_checkpoint: str,
        columns: list[str],
        fit_arguments: dict[str, Any],
        initial: Any = None,
        on_model: Callable[[int, Any], None] | None = None,
        empty_batches: str = "skip",
        module: Any = None,
    ) -> None:
        self._fit, self.published = fit, published
        self.query_checkpoint, self._names = query_checkpoint, columns
        self._arguments, self._on_model = fit_arguments, on_model
        self.empty_batches = check_empty_batches(empty_batches)
        self.model, self.last_batch, self.columns = initial, None, None
        self._query_id: str | None = None  # read from the query checkpoint at the first batch
        self._published_query_id: str | None = None
        latest = published.latest()
        if latest is None:
            return
        if initial is not None:
            raise InputError(
                f"model_path={published.root.url!r} already holds a streaming fit's models (the "
                f"newest after micro-batch {latest.batch_id}), which the fit continues: pass "
                "initial= only with a new model_path"
            )
        if latest.query_checkpoint != query_checkpoint:
            raise InputError(
                f"model_path={published.root.url!r} holds the models of the streaming query "
                f"with checkpoint_location={latest.query_checkpoint!r}, not "
                f"{query_checkpoint!r}: its micro-batch ids are that query's. Restart that "
                "query, or publish to a new model_path (initial= can start it from this model)"
            )
        self.model = published.load(latest, module=module)
        self.last_batch, self.columns = latest.batch_id, latest.columns
        self._published_query_id = latest.query_id

    def _check_same_query(self) -> None:
        """The query checkpoint the published models name, made anew (deleted, then
        started again): its batch ids start from 0 again, and every one up to the
        published id would be skipped as trained already. Refused instead."""
        published, now = self._published_query_id, self._query_id
        if published is not None and now is not None and published != now:
            raise InputError(
                f"checkpoint_location={self.query_checkpoint!r} now holds the streaming query "
                f"{now}, but model_path={self.published.root.url!r} holds the models of query "
                f"{published} (its checkpoint was deleted and made anew?): its micro-batch ids "
                "start again, and those up to the published "
                f"{self.last_batch} would be passed over as trained. Publish to a new model_path "
                "(initial=TrainedModel.load(old_model_path) starts it from this model)"
            )

    @property
    def _stays(self) -> str:
        """What a refused micro-batch leaves published, for its error."""
        if self.last_batch is None:
            return "nothing was published"
        return f"the published model stays the one after micro-batch {self.last_batch}"

    def __call__(self, batch: Any, batch_id: int) -> None:
        """Train on micro-batch ``batch_id`` (a static DataFrame) and publish the model;
        a batch trained already (replayed after a restart) is skipped. A batch that cannot
        train raises, naming it, and leaves the published model as it was."""
        if self._query_id is None:
            self._query_id = query_id_of(self.query_checkpoint)
            self._check_same_query()
        if self.last_batch is not None and batch_id <= self.last_batch:
            log.info(
                "micro-batch %d skipped: the published model has trained on micro-batches up "
                "to %d already",
                batch_id,
                self.last_batch,
            )
            return
        columns = columns_of(batch.schema, self._names)
        if self.columns is not None and columns != self.columns:
            raise InputError(
                f"micro-batch {batch_id}'s training columns are {columns}, the model was trained "
                f"on {self.columns}: a stream's schema must stay the same ({self._stays})"
            )
        if batch.isEmpty():
            message = f"micro-batch {batch_id} has no rows: nothing to train on ({self._stays})"
            if self.empty_batches == "error":
                raise InputError(
                    f"{message}. Filter empty batches out upstream, or check the source "
                    "(empty_batches='skip' passes over them)"
                )
            warnings.warn(f"{message}; passed over (empty_batches='skip')", UserWarning, 2)
            return
        try:
            trained = self._fit(batch, initial=self.model, **self._arguments)
        except InputError as error:  # the data's fault: say which micro-batch's
            raise type(error)(f"micro-batch {batch_id}: {error} ({self._stays})") from error
        self.published.publish(trained, batch_id, self.query_checkpoint, columns, self._query_id)
        self.model, self.last_batch, self.columns = trained, batch_id, columns
        if self._on_model is not None:
            self._on_model(batch_id, trained)
