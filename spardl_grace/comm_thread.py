"""The communication thread: one thread that runs the library's exchanges in the order they
were submitted, and, for CUDA tensors, on a CUDA stream of its own.

Backward writes a bucket's gradients on the caller's current stream. Were the thread to run
its kernels there too, they would queue behind every compute kernel already launched, and no
selection or packing could overlap the rest of backward. So the thread runs them on its own
stream per device, and three things keep that correct:

- an event recorded on the caller's stream when the tensor is handed over, which the thread's
  stream waits for before it reads the tensor (the gradients are complete, not merely
  launched);
- `record_stream` on the handed-over tensor, which tells the caching allocator that the
  thread's stream still uses it, so the caller may drop its reference at once;
- a CUDA-aware `torch.futures.Future` (made with the tensor's device), settled on the thread's
  stream: its `wait()`, and the callbacks of `then()`, make the waiter's current stream wait
  for the result and record the result's memory there.

CPU tensors take none of this: they run as they always did, on the thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import torch


def fulfil(handle: torch.futures.Future, run: Callable[..., Any], *args: Any) -> None:
    """Settle `handle` with run(*args) or the exception it raises."""
    try:
        result = run(*args)
    except BaseException as exc:
        fail(handle, exc)
        return
    handle.set_result(result)


def fail(handle: torch.futures.Future, exc: BaseException) -> None:
    """Settle `handle` with `exc` (torch's stubs type the argument as the result's type)."""
    handle.set_exception(exc)


def future_for(tensor: torch.Tensor) -> torch.futures.Future:
    """A pending future for a result computed from `tensor`: CUDA-aware on `tensor`'s device
    when it is a CUDA tensor (see the module docstring), a plain one otherwise."""
    if tensor.is_cuda:
        return torch.futures.Future(devices=[tensor.device])
    return torch.futures.Future()


class CommThread:
    """One thread, named `name`, that runs submitted work in order (see the module docstring).

    submit(future, tensor, run, *args) hands `tensor` over from the caller's current stream,
    and the thread settles `future` with run(*args) (or its exception) on its own stream of
    `tensor`'s device."""

    def __init__(self, name: str):
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        # Touched by the thread alone: one stream per CUDA device it has worked on.
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def submit(
        self,
        future: torch.futures.Future,
        tensor: torch.Tensor,
        run: Callable[..., Any],
        *args: Any,
    ) -> None:
        """Queue run(*args), which reads `tensor`, to settle `future`; returns at once."""
        ready = None
        if tensor.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
        self._executor.submit(self._run, future, tensor, ready, run, *args)

    def _run(
        self,
        future: torch.futures.Future,
        tensor: torch.Tensor,
        ready: torch.cuda.Event | None,
        run: Callable[..., Any],
        *args: Any,
    ) -> None:
        if ready is None:
            fulfil(future, run, *args)
            return
        stream = self._streams.get(tensor.device)
        if stream is None:
            stream = self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
        # The thread starts on CUDA device 0, not on the device the rank chose.
        with torch.cuda.device(tensor.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            tensor.record_stream(stream)
            fulfil(future, run, *args)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the thread once the work already submitted has run (at once if not `wait`)."""
        self._executor.shutdown(wait=wait)
