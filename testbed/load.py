"""Other work on the machine, on cue: busy processes that share the training run's cores for a
stretch of steps, as a user's other jobs (or a test suite beside a run) do. It is how a run
shows what 'communicator': 'auto' does when a passing load skews what it measures, and
whether it comes back to its choice once the load is gone.
"""
from __future__ import annotations

import os
import subprocess
import sys

#: the busy processes' program: spin until killed
SPIN = "while True: pass"


def load_burst(text: str) -> tuple[int, int]:
    """'STEP:STEPS' as (step, steps): busy processes from the start of step STEP for STEPS
    steps. ValueError naming the form when malformed or out of range."""
    try:
        step, steps = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"expected STEP:STEPS (two integers), e.g. 100:60, got {text!r}") from None
    if step < 0 or steps < 1:
        raise ValueError(f"STEP must be >= 0 and STEPS >= 1, got {text!r}")
    return step, steps


class LoadBurst:
    """`processes` busy processes (default: one per core) running from step `start` until step
    `start + steps`; call at_step(step) at the start of every step and stop() at the end of the
    run (a run that ends inside the burst leaves nothing spinning)."""

    def __init__(self, start: int, steps: int, processes: int | None = None):
        self.start, self.end = start, start + steps
        self.processes = processes or os.cpu_count() or 1
        self._running: list[subprocess.Popen[bytes]] = []

    @property
    def running(self) -> bool:
        """Whether the busy processes are running now."""
        return bool(self._running)

    def at_step(self, step: int) -> None:
        """Start the busy processes at the burst's first step, stop them at the step after
        its last (a run resumed inside the burst starts them at its first step)."""
        if self.start <= step < self.end and not self._running:
            self._running = [subprocess.Popen([sys.executable, "-c", SPIN])
                             for _ in range(self.processes)]
        elif step >= self.end:
            self.stop()

    def stop(self) -> None:
        """Kill the busy processes, if running, and wait for them."""
        for process in self._running:
            process.kill()
        for process in self._running:
            process.wait()
        self._running = []
