"""spardl_grace.step_hooks: the one pair of torch's global optimizer step hooks through which
the library acts in steps it does not own. Here its count of the steps that the DDP hook's
accumulation check reads; the options it runs in the step are tested with them
(test_frozen_adam, test_user_loops). In one process: no collective runs (the hook state builds
its synchroniser at the first bucket, which these tests never reach)."""
from __future__ import annotations

import pytest
import torch

from spardl_grace import CommHookState

PARAMS = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
          "compress_ratio": 0.05}


class _RaisingSGD(torch.optim.SGD):
    def step(self, closure=None):  # type: ignore[override]
        raise RuntimeError("the user's step failed")


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_each_state_counts_the_steps_of_optimizers_that_hold_its_parameters_only():
    first, second = _model(), _model()
    counted_first, counted_second = CommHookState(PARAMS, first), CommHookState(PARAMS, second)
    sgd_first = torch.optim.SGD(first.parameters(), lr=0.1)
    sgd_part_of_second = torch.optim.SGD(second[1].parameters(), lr=0.1)
    both = torch.optim.SGD([*first[0].parameters(), *second[0].parameters()], lr=0.1)
    for _ in range(3):
        sgd_first.step()
    sgd_part_of_second.step()
    both.step()
    with pytest.raises(RuntimeError, match="step failed"):
        _RaisingSGD(first.parameters(), lr=0.1).step()
    assert (counted_first.optimizer_steps, counted_second.optimizer_steps) == (4, 2)


def test_a_second_state_for_the_same_model_takes_the_count_over():
    model = _model()
    replaced, current = CommHookState(PARAMS, model), CommHookState(PARAMS, model)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert (replaced.optimizer_steps, current.optimizer_steps) == (0, 1)
