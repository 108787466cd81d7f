"""Gradient-sized buffers reused from step to step.

A fresh gradient-sized tensor costs as much as a pass over it, or more: on a CPU, glibc serves
allocations above 32 MB with mmap, so every step pays the page faults of first touching it
again (50 to 150 ms for VGG-16's 59 MB gradient on the 2-core machine the benchmarks ran on).
Two kinds of reuse:

* Scratch: temporaries that never leave the function that asked for them (selection's
  magnitudes and mask). A buffer is valid until the next get() for the same purpose.
* BufferPool: buffers that do leave (a flattened gradient handed to the communicator, a
  compensated gradient, a residual handed to the memory). A buffer is handed out again only
  once no tensor outside the pool shares its storage, so whatever a caller, a memory or a
  saved state dict still holds is never overwritten; when every slot is held, a new tensor is
  allocated, exactly as without the pool.
"""

from __future__ import annotations

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)


class Scratch:
    """Buffers reused from call to call, one per purpose, for per-step temporaries."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(
        self, purpose: str, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A 1-D tensor of `numel` entries (contents undefined)."""
        buffer = self._buffers.get(purpose)
        if (
            buffer is None
            or buffer.numel() < numel
            or buffer.dtype != dtype
            or buffer.device != device
        ):
            buffer = self._buffers[purpose] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]


def _held_elsewhere(buffer: torch.Tensor) -> bool:
    """Whether a tensor other than `buffer` shares its storage. The count includes `buffer`
    itself and the temporary storage object that asks; without torch's count, assume held."""
    if _use_count is None:
        return True
    return _use_count(buffer.untyped_storage()._cdata) > 2


class BufferPool:
    """Up to `slots` buffers per purpose, each handed out again once nothing else holds it.

    Two slots suit a buffer that outlives one step (a residual kept until the next step has
    replaced it); one suffices for a buffer consumed within the step. A pool holds its buffers
    between steps, like DDP's gradient buckets: up to `slots` times the largest size asked for
    each purpose."""

    def __init__(self) -> None:
        self._slots: dict[str, list[torch.Tensor]] = {}

    def take(
        self, purpose: str, numel: int, dtype: torch.dtype, device: torch.device, slots: int = 1
    ) -> torch.Tensor:
        """A 1-D tensor of `numel` entries (contents undefined) that no other tensor shares."""
        held = self._slots.setdefault(purpose, [])
        for i, buffer in enumerate(held):
            if (
                buffer.numel() == numel
                and buffer.dtype == dtype
                and buffer.device == device
                and not _held_elsewhere(buffer)
            ):
                held.append(held.pop(i))  # most recently taken last
                return buffer.view(numel)
        buffer = torch.empty(numel, dtype=dtype, device=device)
        held.append(buffer)
        if len(held) > slots:
            held.pop(0)  # the least recently taken: whoever holds it keeps it alive
        # A view, not the pool's own tensor: the caller's reference must count as a holder.
        return buffer.view(numel)
