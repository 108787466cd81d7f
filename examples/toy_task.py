"""The small task every example trains, kept apart so each example shows only what changes
when you adopt spardl-grace. Replace it with your own model and data.

Each rank draws its own batches of a 10-class problem (the label of x is the argmax of a fixed
linear map of x), so the ranks' gradients differ and synchronisation matters.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

FEATURES, CLASSES = 32, 10


def parse_args(description: str, steps: int = 60) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--density", type=float, default=0.05,
                   help="fraction of gradient entries each step sends")
    return p.parse_args()


def make_model() -> nn.Module:
    """The same initial weights on every rank (a seed), as a real run gets by broadcasting."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def batch(rank: int, step: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of step `step`."""
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(12345))
    x = torch.randn(size, FEATURES, generator=torch.Generator().manual_seed(rank * 100_003 + step))
    return x, (x @ teacher).argmax(1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> float:
    """Forward, backward and optimizer.step() on rank's batch; the loss before the step."""
    x, y = batch(rank, step)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter of `model`, one after another in a 1-D tensor."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def replicas_identical(transport, model: nn.Module) -> bool:
    """Whether every rank holds bit-identical parameters (one all-gather over `transport`)."""
    flat = flat_params(model)
    return all(torch.equal(flat, other) for other in transport.allgather(flat, "example.check"))


def report(rank: int, losses: list[float], identical: bool, extra: str = "") -> None:
    """Rank 0 prints the mean loss of the first and the last ten steps and the replica check."""
    if rank == 0:
        first, last = sum(losses[:10]) / len(losses[:10]), sum(losses[-10:]) / len(losses[-10:])
        print(f"loss {first:.3f} -> {last:.3f} over {len(losses)} steps; "
              f"replicas identical: {identical}{extra}", flush=True)
