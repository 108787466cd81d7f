"""What the training CLI measures besides time and bytes: a model on a test set (mean loss and
accuracy, per token for a language model), and what error feedback still owes (the residual
norm).
"""
from __future__ import annotations

import torch


def flat_outputs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logits and targets of a language model (N x L x V, N x L) as rows; a
    classifier's unchanged."""
    if logits.dim() == 3:
        return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    return logits, labels

def evaluate(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(mean loss, accuracy) over a test set, on the model's device; per token for a language
    model."""
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(images[i:i + 500].to(device)) for i in range(0, len(images), 500)])
    model.train()
    logits, labels = flat_outputs(logits, labels.to(device))
    return (torch.nn.functional.cross_entropy(logits, labels).item(),
            (logits.argmax(1) == labels).float().mean().item())


def residual_norm(grace) -> float:
    """L2 norm of every residual this rank's communicator holds (what error feedback still
    owes)."""
    residuals = getattr(grace.memory, "residuals", {})
    return float(torch.sqrt(sum((r.float() ** 2).sum() for r in residuals.values()))) \
        if residuals else 0.0
