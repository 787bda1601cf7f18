"""A rank's output streamed to the driver as it is written: ``sys.stdout`` and
``sys.stderr`` of the task, for as long as the rank's function runs, write their lines to
the driver's message server too (and still to the executor's log, as before).

Only what goes through Python's ``sys.stdout``/``sys.stderr`` is streamed (``print``,
``logging``'s stream handlers, ``warnings``); what native code writes to the file
descriptors directly stays in the executor's log. A line longer than ``PIECE`` characters
travels in pieces; a part line is sent when it is flushed or when the function ends.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

from allreduce_param.engine.wire.messages import MessageClient

log = logging.getLogger(__name__)

#: The longest text one message carries, in characters (a message holds at most 1 MiB).
PIECE = 64 << 10
#: The kind of the messages that carry a rank's output.
OUTPUT = "output"


class RankStream(io.TextIOBase):
    """A text stream that writes through to ``original`` and sends each complete line to
    the driver as an ``OUTPUT`` message of ``rank`` and ``stream`` (``"stdout"`` or
    ``"stderr"``). Once the driver cannot be reached, it writes to ``original`` only."""

    def __init__(self, original: TextIO, link: MessageClient, rank: int, stream: str) -> None:
        super().__init__()
        self._original = original
        self._link = link
        self._rank = rank
        self._stream = stream
        self._pending = ""
        self._lock = threading.Lock()
        self._lost = False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._original.write(text)
        with self._lock:
            self._pending += text
            cut = self._pending.rfind("\n") + 1  # after the last whole line
            if cut == 0 and len(self._pending) < PIECE:
                return len(text)
            if cut == 0:  # a long part line: sent as it is
                cut = len(self._pending)
            ready, self._pending = self._pending[:cut], self._pending[cut:]
        self._send(ready)
        return len(text)

    def flush(self) -> None:
        self._original.flush()
        with self._lock:
            ready, self._pending = self._pending, ""
        if ready:
            self._send(ready)

    def _send(self, text: str) -> None:
        if self._lost:
            return
        try:
            for start in range(0, len(text), PIECE):
                self._link.send(
                    {
                        "kind": OUTPUT,
                        "rank": self._rank,
                        "stream": self._stream,
                        "text": text[start : start + PIECE],
                    }
                )
        except Exception as error:  # the driver is gone: the executor's log still has it
            self._lost = True
            log.warning("rank %d's output no longer reaches the driver: %s", self._rank, error)

    @property
    def encoding(self) -> str:  # what code that writes bytes to sys.stdout asks first
        return getattr(self._original, "encoding", "utf-8")


@contextlib.contextmanager
def streamed_output(link: MessageClient | None, rank: int) -> Iterator[None]:
    """For the length of the block, ``sys.stdout`` and ``sys.stderr`` also go to the driver
    through ``link`` (None: they stay as they are); put back as they were after it, as the
    Python worker runs other tasks next (``spark.python.worker.reuse``)."""
    if link is None:
        yield
        return
    saved = sys.stdout, sys.stderr
    out = RankStream(saved[0], link, rank, "stdout")
    err = RankStream(saved[1], link, rank, "stderr")
    sys.stdout, sys.stderr = out, err
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        out.flush()
        err.flush()
