"""Live progress of a fit: each task reports its steps to a small server on the driver.

The tasks send one frame per step and one per epoch; the driver merges a step (an epoch)
once every partition has reported it and hands it to a listener: a progress bar, a
JSON-lines log, or a user's callback. Frames are JSON with an HMAC tag under a secret made
for the fit; a frame that is too long or wrongly tagged closes its connection. Reporting is
best effort: a task whose report fails goes on training.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
from typing import Callable, TextIO

import numpy as np

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
_TAG_SIZE = 32
MAX_FRAME = 1 << 20


def _tag(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()


class ProgressReporter:
    """The task's end: sends frames to the driver's ``ProgressServer``; made on the driver."""

    def __init__(self, address: tuple[str, int], secret: bytes) -> None:
        self.address = address
        self._secret = secret
        self._sock: socket.socket | None = None
        self._broken = False

    def __getstate__(self) -> dict:  # the socket stays behind when shipped to a task
        return {"address": self.address, "_secret": self._secret, "_sock": None, "_broken": False}

    def send(self, kind: str, **fields) -> None:
        """Send one frame; after a failure, stay quiet (training goes on without progress)."""
        if self._broken:
            return
        body = json.dumps({"kind": kind, **fields}).encode()
        try:
            if self._sock is None:
                self._sock = socket.create_connection(self.address, timeout=10)
            self._sock.sendall(_LENGTH.pack(len(body)) + body + _tag(self._secret, body))
        except OSError as error:
            log.warning("progress reports to the driver at %s:%s stopped: %s", *self.address, error)
            self._broken = True
            self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class ProgressServer:
    """The driver's end: receives the tasks' frames and merges each step over the partitions.

    ``on_event(kind, fields)`` gets ``("start", {...})`` once per partition, ``("step", merged)``
    when every partition reported a step (``merge`` of their records), and ``("epoch",
    metrics)`` when every partition reported an epoch (``merge_epoch`` of their frames; with
    no ``merge_epoch`` each epoch frame passes as it is). A ``start`` that says the fit
    resumed at ``[epoch, step]`` (Spark retried the stage) drops what the failed attempt left
    half-reported from there on, so no step is merged from two attempts.
    """

    def __init__(self, host: str, partitions: int, merge: Callable[[np.ndarray], dict],
                 on_event: Callable[[str, dict], None],
                 merge_epoch: Callable[[list[dict]], dict] | None = None) -> None:
        self.secret = os.urandom(32)
        self._partitions = partitions
        self._merge = merge
        self._merge_epoch = merge_epoch
        self._on_event = on_event
        self._pending: dict[tuple, list] = {}
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._connections: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="allreduce-progress-accept")]
        self._threads[0].start()

    def reporter(self) -> ProgressReporter:
        """What the tasks use to report here."""
        return ProgressReporter(self.address, self.secret)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._read, args=(conn,), daemon=True, name="allreduce-progress-read")
            with self._lock:
                self._connections.append(conn)
                self._threads.append(thread)
            thread.start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            stream = conn.makefile("rb")
            while True:
                head = stream.read(_LENGTH.size)
                if len(head) < _LENGTH.size:
                    return
                (length,) = _LENGTH.unpack(head)
                if length > MAX_FRAME:
                    log.warning("closed a progress connection: a frame of %d bytes (at most %d)", length, MAX_FRAME)
                    return
                body, tag = stream.read(length), stream.read(_TAG_SIZE)
                if len(body) < length or not hmac.compare_digest(tag, _tag(self.secret, body)):
                    log.warning("closed a progress connection: a frame without the fit's secret")
                    return
                try:
                    self._dispatch(json.loads(body))
                except Exception:  # a listener's bug must not stop the reports
                    log.exception("a progress listener failed")

    def _dispatch(self, frame: dict) -> None:
        kind = frame.pop("kind")
        if kind == "start" and frame.get("resumed"):
            first = ("step", *frame["resumed"])
            with self._lock:  # what this partition's failed attempt reported from there on
                for key, items in self._pending.items():
                    if key[0] == "step" and key >= first:
                        items.pop(frame.get("partition"), None)
        if kind == "step":
            key, item = ("step", int(frame["record"][0]), int(frame["record"][1])), frame["record"]
        elif kind == "epoch" and self._merge_epoch is not None:
            key, item = ("epoch", int(frame["epoch"])), frame
        else:
            self._on_event(kind, frame)
            return
        with self._lock:
            items = self._pending.setdefault(key, {})
            items[frame.get("partition", len(items))] = item  # a partition's own again: the newer
            if len(items) < self._partitions:
                return
            del self._pending[key]
        if kind == "step":
            self._on_event("step", self._merge(np.asarray(list(items.values()), dtype=np.float64)))
        else:
            self._on_event("epoch", self._merge_epoch(list(items.values())))

    def close(self) -> None:
        """Stop listening and wait for the readers."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            connections, threads = list(self._connections), list(self._threads)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join()


class ProgressBar:
    """A listener: a progress bar (terminal or notebook) with epoch, loss and samples/s,
    a line per epoch, and every step and epoch as a JSON line in ``log_file`` if given."""

    def __init__(self, show: bool = True, log_file: TextIO | None = None) -> None:
        self._show = show
        self._log = log_file
        self._bar = None
        self._resumed = 0  # the step the fit last resumed at, shown once
        self._lock = threading.Lock()

    def __call__(self, kind: str, fields: dict) -> None:
        with self._lock:
            if self._log is not None and kind in ("step", "epoch"):
                self._log.write(json.dumps({"kind": kind, **fields}) + "\n")
                self._log.flush()
            if not self._show:
                return
            if kind == "start" and self._bar is None:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=fields["steps"] * fields["epochs"], unit="step", dynamic_ncols=True)
            if kind == "start" and fields.get("done") and self._resumed != fields["done"]:
                self._resumed = fields["done"]
                self._bar.n = fields["done"]
                self._bar.write(f"resumed from the checkpoint after step {fields['done']}")
                self._bar.refresh()
            elif kind == "step" and self._bar is not None:
                seconds = sum(v for k, v in fields.items() if k.endswith("_s"))
                self._bar.set_postfix(epoch=fields["epoch"], loss=f"{fields['loss']:.4f}",
                                      samples_s=f"{fields['samples'] / seconds:,.0f}" if seconds else "-",
                                      refresh=False)  # update() redraws, at tqdm's own pace
                self._bar.update(1)
            elif kind == "epoch" and self._bar is not None:
                shown = ", ".join(f"{k} {v:.4f}" for k, v in fields.items() if k != "epoch" and v is not None)
                self._bar.write(f"epoch {fields['epoch']}: {shown}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
