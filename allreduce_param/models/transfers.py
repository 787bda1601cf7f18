"""How a ``TorchModel`` on a GPU exchanges vectors with the host, where the engine keeps them.

- Weights go up once per call: the engine's flat float32 vector is copied into a pinned
  host buffer of the thread's own (``Staging.upload``), and from there to the device in one
  asynchronous copy; the parameters are views of that one device vector.
- Gradients come down part by part as autograd finishes each (``GradientCopies``): each
  part is copied on a side stream into the same place of a pinned host buffer, and once
  that copy has landed, into the caller's vector, and ``ready(start, stop)`` is called, so
  the engine can send it while backward goes on. A part's copy is checked for having landed
  at every later part (without waiting), and the rest are waited for when backward ends.

- A gradient encoded on the device (``device_codecs.DeviceEncoder``) and streamed comes
  down owner by owner (``EncodedCopies``): each parameter's gradient is put in its place of
  one flat device vector as autograd finishes it, and once an owner's range of it is
  whole, that owner's parts are encoded on the side stream (after the compute stream) and
  their bytes copied into pinned memory; once landed, ``ready(owner, bytes)`` hands them
  over. The last layers' owners go first, while backward goes on.

On the CPU neither is needed: the vectors are the host's, and ``TorchModel`` writes the
gradient in place as before (an encoded one is encoded in the hook, ``run_here``).
``GradientCopies`` and ``EncodedCopies`` take their copy function as an argument, so the
order they keep (every part lands before ``ready`` says so) is tested on the CPU with a
stand-in for the CUDA copies.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from allreduce_param.errors import AllReduceError


class Landing(Protocol):
    """A copy under way: ``query()`` whether it landed, ``synchronize()`` to wait for it
    (``torch.cuda.Event`` is one)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Landed:
    """The landing of work done at once (on the CPU)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def run_here(work: Callable[[], None]) -> Landing:
    """Run ``work`` now, in this thread (the CPU: nothing is asynchronous); landed."""
    work()
    return _Landed()


class Staging:
    """One thread's pinned host buffers for a model on ``device``: one for the weights going
    up, one for the gradients coming down, each the model's size; and the side stream the
    gradients come down on."""

    def __init__(self, torch: Any, device: Any, size: int) -> None:
        self.torch, self.device = torch, device
        self.up = torch.empty(size, dtype=torch.float32, pin_memory=True)
        self.down = torch.empty(size, dtype=torch.float32, pin_memory=True)
        self.stream = torch.cuda.Stream(device)
        self._uploaded: Any = None  # the event of the last upload: its buffer is in use

    def upload(self, weights: np.ndarray) -> Any:
        """``weights`` on the device: one float32 vector, copied from the pinned buffer (after
        the previous upload from it has landed)."""
        torch = self.torch
        if self._uploaded is not None:
            self._uploaded.synchronize()
        self.up.numpy()[:] = weights
        flat = self.up.to(self.device, non_blocking=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record(torch.cuda.current_stream(self.device))
        return flat

    def download(self, start: int, stop: int, gradient: Any) -> Landing:
        """Start copying ``gradient`` (a device tensor, final) into ``down[start:stop]``, on the
        side stream after what the compute stream has queued; its landing."""
        torch = self.torch
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        flat = gradient.reshape(-1)  # a copy where the gradient is not contiguous
        with torch.cuda.stream(self.stream):
            self.down[start:stop].copy_(flat, non_blocking=True)
            flat.record_stream(self.stream)  # its memory not reused before the copy lands
            landed = torch.cuda.Event()
            landed.record(self.stream)
        return landed

    def aside(self, work: Callable[[], None]) -> Landing:
        """Queue ``work`` (device work) on the side stream, after what the compute stream has
        queued so far; the landing of all of it."""
        torch = self.torch
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            work()
            landed = torch.cuda.Event()
            landed.record(self.stream)
        return landed


class GradientCopies:
    """The parts of one call's gradient, copied into ``out`` in the order they were started,
    each announced by ``ready(start, stop)`` once it is there.

    ``start_copy(start, stop, gradient)`` starts a part's copy into ``landing_zone[start:stop]``
    and returns its ``Landing``; ``part_done`` (autograd's hook) starts one and moves the
    ones that have landed; ``finish`` waits for the rest, after backward."""

    def __init__(
        self,
        out: np.ndarray,
        landing_zone: np.ndarray,
        start_copy: Callable[[int, int, Any], Landing],
        ready: Callable[[int, int], None] | None,
    ) -> None:
        self._out, self._zone, self._start_copy, self._ready = out, landing_zone, start_copy, ready
        self._pending: deque[tuple[Landing, int, int]] = deque()

    def part_done(self, start: int, stop: int, gradient: Any) -> None:
        """Autograd's hook for the part ``[start, stop)``: copy it down; pass on what landed."""
        self._pending.append((self._start_copy(start, stop, gradient), start, stop))
        while self._pending and self._pending[0][0].query():
            self._deliver()

    def finish(self) -> None:
        """Wait for every part still on its way, and pass each on, in order."""
        while self._pending:
            self._pending[0][0].synchronize()
            self._deliver()

    def _deliver(self) -> None:
        _, start, stop = self._pending.popleft()
        self._out[start:stop] = self._zone[start:stop]
        if self._ready is not None:
            self._ready(start, stop)


class EncodedCopies:
    """One call's gradient encoded on the device by ``encoder`` (a ``DeviceEncoder``) owner by
    owner, each owner's bytes handed to ``ready(owner, payload)`` once they have landed on
    the host, in the order the owners became whole.

    ``part_done`` (autograd's hook) puts a parameter's gradient in its place of the
    encoder's flat device vector; when that completes an owner's range, ``run_aside(work)``
    runs the owner's encoding and copy (on a GPU: ``Staging.aside``, the side stream after
    the compute stream; on the CPU: ``run_here``) and returns its landing. ``finish`` waits
    for the rest, after backward; ``abandon`` waits for what is under way and hands nothing
    more over (backward failed). Every element must be given once by then.
    """

    def __init__(
        self,
        encoder: Any,
        run_aside: Callable[[Callable[[], None]], Landing],
        ready: Callable[[int, np.ndarray], None],
    ) -> None:
        self._encoder, self._run_aside, self._ready = encoder, run_aside, ready
        self._flat = encoder.gradient
        self._layout = encoder.plan.layout
        self._waiting = {  # elements of each owner's range not given yet
            owner: self._layout.length(owner) for owner in range(self._layout.partition_num)
        }
        self._pending: deque[tuple[Landing, int]] = deque()
        for owner in [owner for owner, left in self._waiting.items() if not left]:
            self._encode(owner)  # an empty chunk: nothing to wait for

    def part_done(self, start: int, stop: int, gradient: Any) -> None:
        """Autograd's hook for the part ``[start, stop)``: put it in place; encode the owners
        it completes; hand over those that landed."""
        self._flat[start:stop].copy_(gradient.reshape(-1))
        for owner in self._layout.owners(start, stop):
            if owner in self._waiting:
                bounds = self._layout.bounds(owner)
                self._waiting[owner] -= min(stop, bounds.stop) - max(start, bounds.start)
                if self._waiting[owner] == 0:
                    self._encode(owner)
        while self._pending and self._pending[0][0].query():
            self._deliver()

    def finish(self) -> None:
        """Wait for every owner's bytes still on their way, and hand each over, in order."""
        left = sorted(owner for owner, count in self._waiting.items() if count)
        if left:
            raise AllReduceError(
                f"the gradient's range of owner(s) {left} was never given whole "
                "(a parameter's hook did not run): nothing was sent for them"
            )
        while self._pending:
            self._pending[0][0].synchronize()
            self._deliver()

    def abandon(self) -> None:
        """Backward failed: wait for the copies under way (their buffers are reused), hand
        nothing more over."""
        while self._pending:
            self._pending.popleft()[0].synchronize()

    def _encode(self, owner: int) -> None:
        encoder, flat = self._encoder, self._flat
        del self._waiting[owner]
        landing = self._run_aside(lambda: encoder.encode_owner(owner, flat))
        self._pending.append((landing, owner))

    def _deliver(self) -> None:
        _, owner = self._pending.popleft()
        self._encoder.check_owner(owner)
        self._ready(owner, self._encoder.owner_payload(owner))
