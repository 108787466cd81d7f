"""spardl_grace.adam_advice: the warning for an Adam stepping on a selection of the raw
gradient (measured far behind dense on the transformer), and only then. Ranks are threads of
run_local; the DDP hook's and FSDP2's warning is checked under torchrun in test_user_loops
and test_fsdp."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch

import deepreduce_compat  # noqa: F401  (registers DeepReduce's keys)
from spardl_grace import DistributedOptimizer, grace_from_params
from spardl_grace.adam_advice import is_adam_type, selection_of
from spardl_grace.planner import DEFAULT_CANDIDATES
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


AUTO = {"compressor": "topk", "memory": "global_residual", "communicator": "auto",
        "auto_measure_steps": 2}


def _auto_under(optimizer, params: dict = AUTO, steps: int = 4):
    """(each rank's candidates and plan's choice after `steps` steps, the warnings, rank 0's
    'spardl_grace.auto' log lines) of DistributedOptimizer over `optimizer` with `params`."""
    def fn(transport):
        g = torch.Generator().manual_seed(0)
        model = torch.nn.Linear(64, 64)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        grc = grace_from_params(dict(params), transport=transport)
        opt = DistributedOptimizer(optimizer(model.parameters(), lr=0.01), grc,
                                   named_parameters=model.named_parameters())
        data = torch.Generator().manual_seed(1 + transport.rank)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 64, generator=data)).square().mean().backward()
            opt.step()
        return grc.candidates, grc.plan.get("choice")

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lines, log = Lines(), logging.getLogger("spardl_grace.auto")
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outcome = run_local(2, fn)
    finally:
        log.removeHandler(lines)
    return outcome, [str(w.message) for w in caught if "steps on" in str(w.message)], lines.lines


def test_auto_keeps_to_dense_under_an_adam_and_says_so_once():
    """It chose among SparDL's densities on the raw gradient, which trains far behind dense
    under Adam (the warning said so, and the run went on)."""
    outcome, warned, lines = _auto_under(torch.optim.AdamW)
    assert warned == []
    assert [c for c, _ in outcome] == ["dense,dense16"] * 2
    assert outcome[0][1] in ("dense", "dense16") and outcome[0][1] == outcome[1][1]
    said = [line for line in lines if "is an Adam" in line]
    assert len(said) == 1 and "AdamW" in said[0] and "auto_candidates" in said[0]


def test_auto_keeps_its_candidates_under_sgd_and_when_named_under_an_adam():
    default = ",".join(DEFAULT_CANDIDATES)
    outcome, warned, _ = _auto_under(torch.optim.SGD)
    assert [c for c, _ in outcome] == [default] * 2 and warned == []
    named = {**AUTO, "auto_candidates": ["dense", "spardl@0.01"]}
    outcome, warned, _ = _auto_under(torch.optim.Adam, named, steps=1)
    assert [c for c, _ in outcome] == ["dense,spardl@0.01"] * 2
    assert len(warned) == 2 and "'auto', which may choose spardl@0.01" in warned[0]


def test_keep_to_dense_only_before_the_first_plan_and_with_a_dense_candidate():
    from spardl_grace.communicators.auto import Auto
    from spardl_grace.memories import ResidualMemory

    def fn(t):
        sparse_only = Auto(ResidualMemory(), t, candidates=["spardl@0.1", "spardl@0.01"])
        auto = Auto(ResidualMemory(), t, candidates=["dense", "spardl@0.1"], measure_steps=2)
        for _ in range(3):
            auto.synchronize(torch.ones(4), "w")
        return sparse_only.keep_to_dense(), bool(auto.plan), auto.keep_to_dense(), auto.candidates

    assert run_local(2, fn) == [(False, True, False, "dense,spardl@0.1")] * 2


def test_a_plan_among_the_dense_candidates_resumes_kept_to_them():
    """The DDP hook's state loads before its first step, where keep_to_dense runs: a plan made
    among dense and dense16 stands, and the candidates are kept to them again (it said SparDL
    was a choice, and warned)."""
    from spardl_grace.communicators.auto import Auto
    from spardl_grace.memories import ResidualMemory

    def fn(t):
        first = Auto(ResidualMemory(), t, measure_steps=2)
        first.keep_to_dense()
        for _ in range(3):
            first.synchronize(torch.ones(4), "w")
        resumed = Auto(ResidualMemory(), t, measure_steps=2)
        resumed.load_state_dict(first.state_dict())
        return resumed.keep_to_dense(), resumed.candidates, resumed.plan == first.plan

    assert run_local(2, fn) == [(True, "dense,dense16", True)] * 2
