"""spardl_grace.adam_advice: the warning for an Adam stepping on a selection of the raw
gradient (measured far behind dense on the transformer), and only then. Ranks are threads of
run_local; the DDP hook's and FSDP2's warning is checked under torchrun in test_user_loops
and test_fsdp."""
from __future__ import annotations

import warnings

import pytest
import torch

import deepreduce_compat  # noqa: F401  (registers DeepReduce's keys)
from spardl_grace import DistributedOptimizer, grace_from_params
from spardl_grace.adam_advice import is_adam_type, selection_of
from spardl_grace.transport import run_local

SPARDL = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
          "compress_ratio": 0.01}

#: configurations -> whether they send a selection of the raw gradient
CASES = {
    "spardl": (SPARDL, True),
    "topkA": ({**SPARDL, "communicator": "topka"}, True),
    "gtopk": ({**SPARDL, "communicator": "gtopk"}, True),
    "grace topk over allgather": ({"compressor": "topk", "memory": "residual",
                                   "communicator": "allgather", "compress_ratio": 0.01}, True),
    "grace randomk": ({"compressor": "randomk", "memory": "residual",
                       "communicator": "allgather", "compress_ratio": 0.01}, True),
    "grace dgc": ({"compressor": "dgc", "memory": "dgc", "communicator": "allgather",
                   "compress_ratio": 0.01}, True),
    "deepreduce": ({"compressor": "topk", "memory": "residual", "communicator": "allgather",
                    "compress_ratio": 0.01, "deepreduce": "index", "index": "bloom"}, True),
    "auto": ({"compressor": "topk", "memory": "global_residual", "communicator": "auto"}, True),
    "auto, dense only": ({"compressor": "topk", "memory": "global_residual",
                          "communicator": "auto", "auto_candidates": ["dense", "dense16"]}, False),
    "spardl at density 1": ({**SPARDL, "compress_ratio": 1.0}, False),
    "dense": ({"compressor": "none", "memory": "none", "communicator": "dense"}, False),
    "qsgd": ({"compressor": "qsgd", "memory": "none", "communicator": "allgather"}, False),
    "powersgd": ({"compressor": "powersgd", "memory": "powersgd", "communicator": "allreduce"},
                 False),
    "frozen variance": ({**SPARDL, "adam_freeze_step": 10}, False),
    "the step exchanged": ({**SPARDL, "exchange": "update"}, False),
}


def test_the_selections_of_the_raw_gradient_are_told_from_the_rest():
    def fn(transport):
        return {name: selection_of(grace_from_params(dict(params), transport=transport))
                for name, (params, _) in CASES.items()}

    for told in run_local(2, fn):
        for name, (_, selects) in CASES.items():
            assert (told[name] is not None) == selects, (name, told[name])
    assert told["spardl"] == "SparDL at density 0.01"
    assert "may choose spardl@" in told["auto"]
    assert "TopKCompressor" in told["deepreduce"]


@pytest.mark.parametrize("optimizer, adam", [
    (torch.optim.Adam, True), (torch.optim.AdamW, True), (torch.optim.NAdam, True),
    (torch.optim.RAdam, True), (torch.optim.Adamax, True), (torch.optim.SGD, False),
    (torch.optim.RMSprop, False),
])
def test_adam_types_are_told_by_their_classes(optimizer, adam):
    class Subclassed(optimizer):  # a user's own subclass of any of them
        pass

    params = [torch.nn.Parameter(torch.zeros(2))]
    assert is_adam_type(optimizer(params, lr=0.1)) == adam
    assert is_adam_type(Subclassed(params, lr=0.1)) == adam


def _wrapped(params: dict, optimizer) -> list[str]:
    """The warnings of DistributedOptimizer wrapping `optimizer` over `params` on 2 ranks."""
    def fn(transport):
        model = torch.nn.Linear(4, 4)
        DistributedOptimizer(optimizer(model.parameters(), lr=0.01),
                             grace_from_params(dict(params), transport=transport),
                             named_parameters=model.named_parameters())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_local(2, fn)
    return [str(w.message) for w in caught if "steps on" in str(w.message)]


def test_distributed_optimizer_warns_for_adam_on_a_selected_gradient_and_says_what_instead():
    warned = _wrapped(SPARDL, torch.optim.AdamW)
    assert len(warned) == 2  # each rank
    assert "AdamW steps on SparDL at density 0.01" in warned[0]
    assert "'exchange': 'update'" in warned[0] and "choosing.md" in warned[0]


@pytest.mark.parametrize("params, optimizer", [
    (SPARDL, torch.optim.SGD),
    ({**SPARDL, "adam_freeze_step": 10}, torch.optim.AdamW),
    ({**SPARDL, "exchange": "update"}, torch.optim.AdamW),
    ({"compressor": "none", "memory": "none", "communicator": "dense"}, torch.optim.Adam),
])
def test_no_warning_where_nothing_was_measured_behind(params, optimizer):
    assert _wrapped(params, optimizer) == []
