"""Ranks whose data run out at different steps: spardl_grace.join_uneven_inputs under every
launcher and in-process, and torch's Join with the DDP hook. A rank that ran out must send
exactly what a rank with zero gradients sends, and every rank must end each block with the same
parameters and optimizer state (tests/uneven_scenarios.py)."""
from __future__ import annotations

import warnings

import pytest
import torch
import uneven_scenarios as us
from conftest import run_ranks

import spardl_grace
from benchmarks.user_loops import same_values as _same
from spardl_grace.transport import run_local


def _check(results: list[dict], residuals: bool = True) -> None:
    size = len(results)
    for rank, r in enumerate(results):
        joined, padded = r["joined"], r["padded"]
        assert joined["joins"] == [(0, 2 * rank), (size - 1, 2 * (size - 1 - rank))]
        # a rank that ran out sent what zero gradients send: the same residuals and steps
        assert _same(joined["compression"], padded["compression"])
        assert _same(joined["params"], padded["params"])
        assert _same(joined["optimizer"], padded["optimizer"])
        # every rank holds the last rank's model and AdamW state (its step count included)
        assert _same(joined["params"], results[0]["joined"]["params"])
        assert _same(joined["optimizer"], results[0]["joined"]["optimizer"])
    if residuals:  # they stay each rank's own
        own = [r["joined"]["compression"]["grace"] for r in results]
        assert not _same(own[0], own[1])


@pytest.mark.parametrize("launcher", ["gloo", "mpi", "horovod"])
def test_ranks_that_run_out_send_zero_gradients_and_end_with_the_last_ranks_model(
        launcher, tmp_path):
    _check(run_ranks(launcher, 3, "uneven_scenarios.joined_and_padded", tmp_path, timeout=300))


@pytest.mark.parametrize("params", [
    us.PARAMS,
    {"communicator": "dense"},
    {**us.PARAMS, "communicator": "oktopk", "oktopk_threshold_interval": 2},
    {**us.PARAMS, "density_warmup_steps": 3},
], ids=["spardl", "dense", "oktopk", "density-warmup"])
def test_the_joined_steps_equal_zero_gradient_steps_for_each_communicator(params):
    def both(transport):
        return {"joined": us.joined(transport, params),
                "padded": us.padded_with_zero_gradients(transport, params)}

    _check(run_local(4, both), residuals=params["communicator"] != "dense")


def test_exchanging_updates_every_second_step_ends_with_identical_replicas():
    """'exchange': 'update' communicates only every 'exchange_period' steps: a rank that ran
    out waits for those alone, and the block ends with the last rank's outer state too."""
    params = {**us.PARAMS, "exchange": "update", "exchange_period": 2, "outer_momentum": 0.5}
    results = run_local(3, us.joined, params)
    for rank, r in enumerate(results):
        assert r["joins"][0] == (0, rank)  # 2 * rank steps, every second one an exchange
        assert _same(r["params"], results[0]["params"])
        assert _same(r["compression"]["outer"], results[0]["compression"]["outer"])


def test_a_rank_without_any_batch_takes_part_and_ends_with_the_model():
    def fn(transport):
        model, opt = us._optimizer(transport, us.PARAMS)
        with spardl_grace.join_uneven_inputs(opt) as block:
            for x, y in us.batches(transport.rank, transport.size, 3 * (transport.rank > 0)):
                us._step(model, opt, x, y)
        return block.last_rank, block.steps_without_data, us.flat_params(model), opt._sync.steps

    results = run_local(3, fn)
    assert [r[:2] for r in results] == [(2, 3), (2, 0), (2, 0)]
    assert all(torch.equal(r[2], results[2][2]) and r[3] == 3 for r in results)


def test_bad_uses_are_refused_with_what_to_do():
    model = us.mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"DistributedOptimizer.*torch.distributed.algorithms.Join"):
        spardl_grace.join_uneven_inputs(sgd)

    def fn(transport):
        _, opt = us._optimizer(transport, us.PARAMS)
        errors = []
        with spardl_grace.join_uneven_inputs(opt):
            try:
                with spardl_grace.join_uneven_inputs(opt):
                    pass
            except ValueError as exc:
                errors.append(str(exc))
        frozen = us.mlp()
        for p in frozen.parameters():
            p.requires_grad_(False)
        none = spardl_grace.DistributedOptimizer(
            torch.optim.SGD(frozen.parameters(), lr=0.1),
            spardl_grace.grace_from_params(dict(us.PARAMS), transport),
            named_parameters=frozen.named_parameters())
        try:
            spardl_grace.join_uneven_inputs(none)
        except ValueError as exc:
            errors.append(str(exc))
        return errors

    for errors in run_local(2, fn):
        assert "already inside" in errors[0] and "join_uneven_inputs(a, b)" in errors[0]
        assert "no parameter that needs a gradient" in errors[1]


def test_an_error_inside_the_block_leaves_it_without_waiting_for_the_others():
    """The rank that raised does not step on as a rank without data (it would train on);
    the others, still stepping, fail with the transport's timeout, as without the block."""
    def fn(transport):
        model, opt = us._optimizer(transport, us.PARAMS)
        try:
            with spardl_grace.join_uneven_inputs(opt):
                for step, (x, y) in enumerate(us.batches(transport.rank, transport.size, 3)):
                    if transport.rank == 1 and step == 1:
                        raise KeyError("the user's bug")
                    us._step(model, opt, x, y)
        except KeyError:
            return "raised", opt._join
        except spardl_grace.transport.TransportError as exc:
            return type(exc).__name__, opt._join
        return "finished", opt._join

    results = run_local(2, fn, timeout=5)
    assert results[1] == ("raised", None)
    assert results[0][0] in ("TransportTimeout", "PeerFailure")


def test_torchs_join_with_the_ddp_hook_sends_zero_buckets_and_gives_the_last_ranks_state(
        tmp_path):
    """DDP's Join runs the hook with zero buckets on the ranks that ran out, outside backward
    and with no optimizer step: the hook raised 'synchronised the gradients twice' there. With
    SameOptimizerState every rank also takes the momentum of the rank DDP takes the parameters
    from (the last to end, here rank 2; broadcasting rank 0's paired its stale momentum with
    rank 2's parameters), and a rank with no batch at all is not told it resumed afresh."""
    results = run_ranks("gloo", 3, "uneven_scenarios.ddp_join", tmp_path, timeout=300)
    for r in results:
        joined, padded = r["joined"], r["padded"]
        assert joined["warnings"] == [] and joined["steps"] == padded["steps"] == 12
        assert _same(joined["params"], padded["params"])
        assert _same(joined["momentum"], padded["momentum"])
        assert joined["schedule"] == padded["schedule"]
        empty_first = r["empty_first"]
        assert empty_first["warnings"] == [] and empty_first["steps"] == 10
        for run in ("joined", "empty_first"):
            assert _same(r[run]["params"], results[0][run]["params"])
            assert _same(r[run]["momentum"], results[0][run]["momentum"])
            assert r[run]["schedule"] == results[0][run]["schedule"]
        left_out = r["scheduler_left_out"]["warnings"]
        assert len(left_out) == 2 and "steps by rank: [2, 4, 6]" in left_out[0]
        assert "SameOptimizerState(optimizer, stateful=[scheduler])" in left_out[0]


def test_a_per_batch_scheduler_given_to_the_block_follows_the_last_rank_and_one_left_out_warns():
    """A scheduler stepped per batch counts its own rank's steps. Given as stateful, every rank
    takes the last rank's at the block's end: the run equals the padded reference, schedule
    included, with no warning. Left out, every rank warns at each block's end: after the first
    both because the ranks stepped it differently and because their learning rates were not
    the last rank's; after the second, where every rank's scheduler ends at 8 steps and the
    learning rates agree, because of the steps alone. The replicas differ from the reference."""
    def run(scheduler):
        def both(transport):
            return {"joined": us.joined(transport, scheduler=scheduler),
                    "padded": us.padded_with_zero_gradients(transport, scheduler="stateful")}
        # caught here, not in the ranks' threads: catch_warnings swaps process-wide state
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = run_local(3, both)
        return results, [str(w.message) for w in caught if "spardl_grace.join" in str(w.message)]

    given, warned = run("stateful")
    _check(given)
    assert warned == []
    for r in given:
        assert r["joined"]["schedule"] == r["padded"]["schedule"] == given[0]["joined"]["schedule"]
        assert r["joined"]["schedule"]["steps"] == 6 + 6  # the longest shard of each epoch
    assert run("none")[1] == []
    left_out, warned = run("own")
    assert len(warned) == 6  # on each rank, at each block's end
    first, second = sorted(set(warned), key=lambda w: "rank 0's" not in w)
    assert "steps by rank: [6, 4, 2]" in first and "ranks [1, 2] differed from rank 0's" in first
    assert "steps by rank: [2, 4, 6]" in second and "differed from" not in second
    assert "join_uneven_inputs(optimizer, stateful=[scheduler])" in first
    for r in left_out:
        assert not _same(r["joined"]["params"], r["padded"]["params"])


def test_the_ranks_must_give_the_block_the_same_kinds_of_stateful_objects():
    def fn(transport):
        _, opt = us._optimizer(transport, us.PARAMS)
        stateful = [us._per_batch_schedule(opt)] if transport.rank == 0 else []
        with pytest.raises(ValueError, match="the join's stateful objects"):
            with spardl_grace.join_uneven_inputs(opt, stateful=stateful):
                pass
        with pytest.raises(TypeError, match=r"state_dict.*got int"):
            spardl_grace.join_uneven_inputs(opt, stateful=[3])
        with pytest.raises(TypeError, match=r"stateful=\[scheduler\]"):
            spardl_grace.join_uneven_inputs(opt, stateful=us._per_batch_schedule(opt))
        # a state the others cannot load (here: rank 0 refuses rank 1's): every rank raises
        with pytest.raises(ValueError, match=r"ranks \[0\] could not load .*_Picky"):
            with spardl_grace.join_uneven_inputs(opt, stateful=[_Picky(transport.rank)]):
                pass
        return "raised"

    assert run_local(2, fn) == ["raised", "raised"]


class _Picky:
    def __init__(self, rank: int):
        self.rank = rank

    def state_dict(self) -> dict:
        return {"rank": self.rank}

    def load_state_dict(self, state: dict) -> None:
        raise KeyError(f"rank {self.rank} takes no state of rank {state['rank']}")


def test_auto_plans_alike_on_every_rank_while_some_ranks_have_no_data():
    """'auto' measures its first steps and takes rank 0's plan: rank 0 runs out first in the
    second epoch, and its steps without data are measured too; the ranks still plan alike."""
    params = {"compressor": "topk", "memory": "global_residual", "communicator": "auto",
              "auto_measure_steps": 2, "min_entries": 0}
    results = run_local(3, us.joined, params)
    for r in results:
        assert _same(r["params"], results[0]["params"])
        assert _same(r["optimizer"], results[0]["optimizer"])
        assert r["compression"]["steps"] == results[0]["compression"]["steps"] == 12


def test_a_loop_left_between_backward_and_step_has_that_steps_exchange_finished():
    """A step budget checked after backward(): the block's exit ran its count while the
    communication thread still sent that step's buckets (the ranks' messages collided). Now
    the exit finishes that exchange first, without the optimizer's step."""
    def fn(transport):
        model, opt = us._optimizer(transport, us.PARAMS)
        budget = 2 + transport.rank
        with spardl_grace.join_uneven_inputs(opt) as block:
            for step, (x, y) in enumerate(us.batches(transport.rank, transport.size, 9)):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                if step == budget:
                    break
                opt.step()
        return us.flat_params(model), opt._sync.steps, block.last_rank, block.steps_without_data

    results = run_local(3, fn)
    assert [r[1:] for r in results] == [(5, 2, 2), (5, 2, 1), (5, 2, 0)]
    assert all(torch.equal(r[0], results[0][0]) for r in results)


def _check_gan(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert (r["last_rank"], r["steps_without_data"], r["steps"]) == (
            len(results) - 1, 4 * (len(results) - 1 - rank), (6, 6))
        assert torch.equal(r["gen"], results[0]["gen"])
        assert torch.equal(r["disc"], results[0]["disc"])


@pytest.mark.parametrize("launcher", ["gloo", "mpi", "horovod"])
def test_a_gans_two_optimizers_built_the_default_way_join_in_one_block(launcher, tmp_path):
    """Generator and discriminator each with a DistributedOptimizer (a channel each), stepped in
    turn: the ranks that ran out take each one's steps in the order the others take them (with
    a block per optimizer they waited in different blocks: a hang under torchrun), the votes
    going over the process's channel for one-off collectives."""
    _check_gan(run_ranks(launcher, 3, "uneven_scenarios.gan_joined", tmp_path, timeout=300))


def test_a_gans_two_optimizers_on_one_transport_join_in_one_block():
    _check_gan(run_local(3, lambda t: us.gan_joined(None, t)))


def test_with_exchange_period_the_rank_with_unexchanged_local_steps_gives_the_model():
    """Ranks with 3 and 2 batches, exchanging every second step, end at the same exchange:
    rank 0, whose third step is local and not yet exchanged, gives the model (the highest rank
    gave it, and that step was lost)."""
    params = {**us.PARAMS, "exchange": "update", "exchange_period": 2}

    def fn(transport):
        model, opt = us._optimizer(transport, params)
        with spardl_grace.join_uneven_inputs(opt) as block:
            for x, y in us.batches(transport.rank, transport.size, 3 - transport.rank):
                us._step(model, opt, x, y)
        return us.flat_params(model), block.last_rank, opt._local_steps

    results = run_local(2, fn)
    assert [r[1] for r in results] == [0, 0]
    assert torch.equal(results[0][0], results[1][0])


def test_optimizers_on_two_transports_or_twice_are_refused():
    from spardl_grace.transport.counting import CountingTransport

    def fn(transport):
        _, a = us._optimizer(transport, us.PARAMS)
        _, b = us._optimizer(CountingTransport(transport), us.PARAMS)
        errors = []
        for given in ((a, b), (a, a), ()):
            try:
                spardl_grace.join_uneven_inputs(*given)
            except ValueError as exc:
                errors.append(str(exc))
        return errors

    for errors in run_local(2, fn):
        assert "different transports" in errors[0] and "given twice" in errors[1]
        assert "takes the DistributedOptimizers" in errors[2]


def test_same_optimizer_state_must_follow_the_ddp_model_in_joins_list():
    """The first joinable tells torch's Join which ranks still have data (DDP's forward does):
    first in the list, it would pair Join's counts with nothing."""
    from torch.distributed.algorithms.join import Join

    from spardl_grace.join import SameOptimizerState

    sgd = torch.optim.SGD(us.mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"Join\(\[ddp_model, SameOptimizerState\(optimizer\)\]\)"):
        Join([SameOptimizerState(sgd)])
    with pytest.raises(TypeError, match=r"torch\.optim optimizer"):
        SameOptimizerState(us.mlp())


def test_two_optimizers_synchronising_in_one_backward_are_refused_inside_a_block():
    """Parameter groups split between two DistributedOptimizers: a rank that ran out takes one
    optimizer's step at a time, so the ranks with data would wait on each other's buckets."""
    def fn(transport):
        model = us.mlp()
        first, second = (spardl_grace.DistributedOptimizer(
            torch.optim.SGD(list(layer.parameters()), lr=0.1),
            spardl_grace.grace_from_params(dict(us.PARAMS), transport),
            named_parameters=[(f"{i}.{n}", p) for n, p in layer.named_parameters()])
            for i, layer in ((0, model[0]), (2, model[2])))
        with spardl_grace.join_uneven_inputs(first, second):
            for x, y in us.batches(transport.rank, transport.size, 2):
                torch.nn.functional.cross_entropy(model(x), y).backward()
                first.step()
                second.step()

    with pytest.raises(ValueError, match="synchronise in one backward pass"):
        run_local(2, fn, timeout=20)
