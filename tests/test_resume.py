"""Resuming from one rank's checkpoint (Horovod's pattern): rank 0 loads the model and the
optimizer state, then every rank broadcasts them from rank 0.

- Horovod's own hvd.broadcast_optimizer_state works on spardl_grace.DistributedOptimizer for
  every torch.optim optimizer Horovod supports (all but LBFGS and SparseAdam): on the ranks
  without state it steps on zero gradients, which must not synchronise (the ranks with state
  never join). Afterwards every rank's optimizer state is rank 0's, bit for bit.
- spardl_grace.broadcast_optimizer_state does the same under every launcher, and applies the
  documented rule to the compression state: residuals stay each rank's own, a fresh rank
  takes root's step counters, ranks that restored other steps all raise at once.
- A step that only some ranks take fails on those ranks within first_step_timeout, naming the
  bucket, instead of the transport's 300 s.
- step() after synchronize() without skip_synchronize() warns as Horovod does, and the
  gradients are synchronised once.

Real processes under horovodrun (gloo, MPI) and torchrun; threads (run_local) for the rest.
"""
from __future__ import annotations

import copy
import subprocess
import time
import warnings

import pytest
import torch

import spardl_grace
from spardl_grace import grace_from_params
from spardl_grace.transport import run_local
from spardl_grace.transport import TransportTimeout

#: every torch.optim optimizer Horovod's broadcast_optimizer_state supports
OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=1e-3),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01),
    "Muon": lambda p: torch.optim.Muon(p, lr=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
}

PARAMS = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
          "compress_ratio": 0.3}


def _model(seed: int) -> torch.nn.Module:
    """Weights only (2-D), so that Muon applies too, drawn from their own generator (ranks are
    threads in some tests: the global one would race)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3, bias=False))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def _backward(model: torch.nn.Module, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    torch.nn.functional.cross_entropy(model(x), y).backward()


def _checkpointed_state(name: str) -> dict:
    """An optimizer state after two local steps: what rank 0 reads from its checkpoint."""
    model = _model(7)
    optimizer = OPTIMIZERS[name](model.parameters())
    for step in range(2):
        optimizer.zero_grad()
        _backward(model, 0, step)
        optimizer.step()
    return optimizer.state_dict()


def _flat(value, prefix="") -> dict:
    """Every leaf of a state_dict by its path."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}{i}.").items()}
    return {prefix: value}


def same_state(a: dict, b: dict) -> bool:
    """Whether two state_dicts are equal bit for bit (tensors by bytes, with dtype)."""
    fa, fb = _flat(a), _flat(b)
    if fa.keys() != fb.keys():
        return False
    for key, x in fa.items():
        y = fb[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                    x.reshape(-1).view(torch.uint8) if x.numel() else x,
                    y.reshape(-1).view(torch.uint8) if y.numel() else y):
                return False
        elif x != y:
            return False
    return True


def _resume(transport, name: str, broadcast: str, seed: int) -> dict:
    """Horovod's resume pattern with `name`: the model differs per rank (seed) until
    broadcast; rank 0 alone loads the optimizer state; broadcast (Horovod's functions, or this
    library's); then one training step. Returns the state after the broadcast and the
    parameters after the step."""
    model = _model(seed + transport.rank)
    grc = grace_from_params(PARAMS, transport=transport)
    optimizer = spardl_grace.DistributedOptimizer(
        OPTIMIZERS[name](model.parameters()), grc, named_parameters=model.named_parameters())
    if transport.rank == 0:
        optimizer.load_state_dict(_checkpointed_state(name))
    if broadcast == "horovod":
        import horovod.torch as hvd
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    else:
        spardl_grace.broadcast_parameters(model.state_dict(), 0, transport)
        spardl_grace.broadcast_optimizer_state(optimizer, 0)
    state = copy.deepcopy(optimizer.state_dict())  # step() changes its tensors in place
    optimizer.zero_grad()
    _backward(model, transport.rank, 5)
    optimizer.step()
    return {"state": state, "params": [p.detach().clone() for p in model.parameters()]}


def _check_resumed(results: list[dict]) -> None:
    for name in OPTIMIZERS:
        root = results[0][name]
        assert same_state(root["state"], _checkpointed_state(name)), name
        for other in results[1:]:
            assert same_state(other[name]["state"], root["state"]), name
            assert all(torch.equal(a, b) for a, b in zip(other[name]["params"], root["params"]))


def horovod_resume(transport) -> dict:
    """Horovod's resume pattern with hvd.broadcast_optimizer_state, every optimizer."""
    return {name: _resume(transport, name, "horovod", seed=i) for i, name in enumerate(OPTIMIZERS)}


def library_resume(transport) -> dict:
    """The same with spardl_grace.broadcast_parameters and broadcast_optimizer_state."""
    return {name: _resume(transport, name, "spardl", seed=i) for i, name in enumerate(OPTIMIZERS)}


@pytest.mark.parametrize("backend", ["horovod-gloo", "horovod-mpi"])
def test_horovods_resume_pattern_for_every_optimizer(launch, backend):
    """Unchanged apart from the optimizer's name: no hang, rank 0's state on every rank."""
    _check_resumed(launch(backend, 2, "test_resume.horovod_resume", timeout=300))


@pytest.mark.parametrize("backend,size", [("gloo", 3), ("mpi", 2), ("horovod-gloo", 2)])
def test_the_librarys_broadcast_optimizer_state_for_every_optimizer(launch, backend, size):
    _check_resumed(launch(backend, size, "test_resume.library_resume", timeout=300))


def test_broadcast_optimizer_state_on_threads_with_a_plain_optimizer():
    """A plain torch optimizer (no compression state) and LBFGS, which Horovod refuses."""
    def fn(t):
        out = {}
        for name, make in [("Adam", OPTIMIZERS["Adam"]),
                           ("LBFGS", lambda p: torch.optim.LBFGS(p, lr=0.1))]:
            model = _model(t.rank)
            optimizer = make(model.parameters())
            if t.rank == 1:
                def closure():
                    optimizer.zero_grad()
                    x, y = _batch(1, 0)
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    return loss
                optimizer.step(closure)
            spardl_grace.broadcast_optimizer_state(optimizer, root_rank=1, transport=t)
            out[name] = optimizer.state_dict()
        return out

    results = run_local(3, fn)
    for name in ("Adam", "LBFGS"):
        assert _flat(results[1][name]["state"])  # root had state
        assert all(same_state(r[name], results[1][name]) for r in results)


def test_ranks_whose_optimizers_differ_all_raise():
    def fn(t):
        model = _model(0) if t.rank else torch.nn.Linear(6, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with pytest.raises(ValueError, match="disagree on the optimizer to broadcast"):
            spardl_grace.broadcast_optimizer_state(optimizer, 0, transport=t)
        return True

    assert all(run_local(2, fn))


def test_a_bad_root_rank_names_the_valid_ones():
    def fn(t):
        optimizer = torch.optim.SGD(_model(0).parameters(), lr=0.1)
        with pytest.raises(ValueError, match=r"root_rank must be a rank in 0\.\.1"):
            spardl_grace.broadcast_optimizer_state(optimizer, 2, transport=t)
        return True

    assert all(run_local(2, fn))


# The compression state ---------------------------------------------------------------------

def _trained(t, steps: int):
    """A DistributedOptimizer (SGD with momentum, SparDL) after `steps` steps."""
    model = _model(0)
    optimizer = spardl_grace.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        grace_from_params({**PARAMS, "density_warmup_steps": 8}, transport=t),
        named_parameters=model.named_parameters())
    for step in range(steps):
        optimizer.zero_grad()
        _backward(model, t.rank, step)
        optimizer.step()
    return model, optimizer


def _residuals(optimizer) -> dict:
    return optimizer.compression_state_dict()["grace"]["memory"]["residuals"]


def _restart(t, saved: dict, restore_compression: list[int], broadcast: bool):
    """A restart from step 3: rank 0 loads the optimizer state; the ranks in
    `restore_compression` load their own compression state; then broadcast_optimizer_state
    (or not) and one step."""
    model, optimizer = _trained(t, 0)
    if t.rank == 0:
        optimizer.load_state_dict(saved["optimizer"][0])
    if t.rank in restore_compression:
        optimizer.load_compression_state_dict(saved["compression"][t.rank])
    if broadcast:
        spardl_grace.broadcast_optimizer_state(optimizer, 0)
    after = copy.deepcopy(optimizer.compression_state_dict())
    optimizer.zero_grad()
    _backward(model, t.rank, 3)
    optimizer.step()
    return after, [p.detach().clone() for p in model.parameters()]


def _save(t):
    _, optimizer = _trained(t, 3)
    return optimizer.state_dict(), optimizer.compression_state_dict()


def _saved() -> dict:
    runs = run_local(3, _save)
    return {"optimizer": [r[0] for r in runs], "compression": [r[1] for r in runs]}


def test_a_fresh_rank_takes_roots_counters_and_keeps_zero_residuals():
    """Rank 0 restores its compression state, ranks 1 and 2 start afresh: afterwards they are
    at rank 0's step with rank 0's warm-up counters and SparDL's h, with no residuals; rank 0
    keeps its own residuals; the next step runs and leaves every rank with the same model."""
    saved = _saved()
    results = run_local(3, _restart, saved, [0], True)
    root = saved["compression"][0]
    assert results[0][0]["steps"] == 3 and _residuals_of(results[0][0]).keys()
    assert same_state(results[0][0], root)
    for after, _ in results[1:]:
        assert after["steps"] == 3
        assert after["grace"]["communicator"] == root["grace"]["communicator"]
        assert not _residuals_of(after)
    assert all(all(torch.equal(a, b) for a, b in zip(r[1], results[0][1])) for r in results)


def _residuals_of(state: dict) -> dict:
    return state["grace"]["memory"]["residuals"]


def test_every_rank_restoring_its_own_compression_state_keeps_it():
    saved = _saved()
    results = run_local(3, _restart, saved, [0, 1, 2], True)
    for rank, (after, _) in enumerate(results):
        assert same_state(after, saved["compression"][rank])


def test_compression_states_of_different_steps_all_raise():
    """Rank 1 restored a compression state of another step than rank 0's: every rank raises
    naming each rank's step, in broadcast_optimizer_state."""
    saved = _saved()
    saved["compression"][1] = {**saved["compression"][1], "steps": 2}

    def fn(t):
        with pytest.raises(ValueError, match=r"different steps \(by rank: \[3, 2, 0\]\)"):
            _restart(t, saved, [0, 1], True)
        return True

    assert all(run_local(3, fn))


def test_without_the_broadcast_mixed_compression_steps_raise_at_the_first_step():
    """Horovod's hvd.broadcast_optimizer_state carries no compression state: rank 0 alone
    restoring its own would put the ranks at different steps. The first step's layout check
    makes every rank raise, naming the way out, instead of synchronising out of step."""
    saved = _saved()

    def fn(t):
        with pytest.raises(ValueError, match="compression_state_step.*broadcast_optimizer_state"):
            _restart(t, saved, [0], False)
        return True

    assert all(run_local(3, fn))


def test_the_shared_state_leaves_out_what_is_per_rank():
    """Residuals (the memory) and Ok-Topk's local thresholds are per rank; counters, SparDL's
    h and Ok-Topk's global thresholds are shared."""
    def fn(t):
        out = {}
        for communicator in ("spardl", "oktopk"):
            grc = grace_from_params({**PARAMS, "communicator": communicator}, transport=t)
            for step in range(3):
                grc.step(torch.randn(64, generator=torch.Generator().manual_seed(step + t.rank)), "w")
            out[communicator] = grc.shared_state_dict()
        return out

    shared = run_local(2, fn)[0]
    for state in shared.values():
        assert "memory" not in state and state["communicator"]["steps"] == {"w": 3}
    assert "h" in shared["spardl"]["communicator"]
    assert "theta_global" in shared["oktopk"]["communicator"]
    assert "theta_local" not in shared["oktopk"]["communicator"]


# A step that only some ranks take -----------------------------------------------------------

def _one_sided(t, timeout: float):
    model = _model(0)
    optimizer = spardl_grace.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01), grace_from_params(PARAMS, transport=t),
        named_parameters=model.named_parameters(), first_step_timeout=timeout)
    if t.rank != 0:
        time.sleep(timeout + 5)  # stays alive, never steps
        return None
    _backward(model, 0, 0)
    start = time.perf_counter()
    try:
        optimizer.step()
    except TransportTimeout as exc:
        return time.perf_counter() - start, str(exc)
    return None


def test_a_step_on_one_rank_fails_within_the_first_step_timeout():
    """The transport would wait 120 s; the first step waits first_step_timeout (2 s)."""
    results = run_local(2, _one_sided, 2.0, timeout=120)
    waited, message = results[0]
    assert waited < 60
    assert "first synchronisation of bucket" in message and "waited 2 s" in message


def one_sided_step(transport) -> object:
    return _one_sided(transport, 3.0)


def test_a_one_sided_step_fails_fast_under_torchrun(tmp_path):
    """Real processes, the transport's timeout the test's 60 s: rank 0 raises within 3 s and
    saves what it saw; the job then ends with a failure (the collective rank 0 gave up on
    leaves the process group unusable), not a hang."""
    from conftest import ROOT, _env, worker_command

    cmd = worker_command("gloo", 2, "test_resume.one_sided_step", tmp_path)
    subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, timeout=180)
    waited, message = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert waited < 30 and "waited 3 s" in message


def test_the_first_step_timeout_must_be_positive():
    def fn(t):
        with pytest.raises(ValueError, match="first_step_timeout must be > 0"):
            spardl_grace.DistributedOptimizer(torch.optim.SGD(_model(0).parameters(), lr=0.1),
                                              grace_from_params(PARAMS, transport=t),
                                              first_step_timeout=0)
        return True

    assert all(run_local(1, fn))


# Horovod's other call forms -----------------------------------------------------------------

def test_step_after_synchronize_warns_and_synchronises_once():
    def fn(t):
        model = _model(0)
        optimizer = spardl_grace.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), grace_from_params(PARAMS, transport=t),
            named_parameters=model.named_parameters())
        _backward(model, t.rank, 0)
        optimizer.synchronize()
        averaged = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        # Once: one synchronised step, and the gradients step() used are synchronize()'s.
        return optimizer._sync.steps, all(torch.equal(a, p.grad)
                                          for a, p in zip(averaged, model.parameters()))

    # Caught here, not in the ranks' threads: catch_warnings swaps process-wide state, so two
    # threads entering it at once can record each other's warnings or lose both.
    with pytest.warns(UserWarning, match="without optimizer.skip_synchronize") as caught:
        assert run_local(2, fn) == [(1, True), (1, True)]
    assert sum("without optimizer.skip_synchronize" in str(w.message) for w in caught) == 2


def test_a_state_creating_step_on_every_rank_leaves_the_model_and_the_compression_alone():
    """Horovod's broadcast_optimizer_state when no rank has state: every rank steps on zero
    gradients. Nothing is synchronised (a counting transport sees no message), the parameters
    stay as they were even with weight decay, and the optimizer has its state."""
    from spardl_grace.transport import CountingTransport

    def fn(t):
        counting = CountingTransport(t)
        model = _model(0)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = spardl_grace.DistributedOptimizer(
            OPTIMIZERS["SGD"](model.parameters()), grace_from_params(PARAMS, transport=counting),
            named_parameters=model.named_parameters())
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        return len(counting.messages), unchanged, len(optimizer.state), optimizer._sync.steps

    assert run_local(2, fn) == [(0, True, 2, 0)] * 2


def test_a_step_with_zero_gradients_after_backward_is_synchronised():
    """Zero gradients from a real backward pass are a real step: it synchronises."""
    def fn(t):
        model = _model(0)
        optimizer = spardl_grace.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), grace_from_params(PARAMS, transport=t),
            named_parameters=model.named_parameters())
        (0 * model(torch.ones(2, 6)).sum()).backward()
        optimizer.step()
        return optimizer._sync.steps

    assert run_local(2, fn) == [1, 1]



# A resume with the wrong compression state, or none -----------------------------------------

def _resumed(t, saved: dict, compression_of: int | None):
    """A new job at step 3: every rank loads rank 0's optimizer state and, unless
    `compression_of` is None, the compression state rank (rank + compression_of) % 3 saved;
    then one step. Returns the error that step raised."""
    model, optimizer = _trained(t, 0)
    optimizer.load_state_dict(copy.deepcopy(saved["optimizer"][0]))
    if compression_of is not None:
        state = copy.deepcopy(saved["compression"][(t.rank + compression_of) % t.size])
        optimizer.load_compression_state_dict(state)
    optimizer.zero_grad()
    _backward(model, t.rank, 3)
    try:
        optimizer.step()
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("offset, expected", [
    (None, "Some ranks restored another rank's compression state"),  # rank 0's everywhere
    (1, "restored the compression state that rank"),  # every rank another's
])
def test_a_compression_state_another_rank_saved_raises_on_every_rank(offset, expected):
    """Rank 0's state on every rank (a checkpoint rank 0 alone wrote) would count rank 0's
    unsent gradient twice and lose the others'; each rank holding another's (files named by
    rank, ranks renumbered) would do the same for all: every rank raises at its first step."""
    saved = _saved()

    def resume(t):
        model, optimizer = _trained(t, 0)
        optimizer.load_state_dict(copy.deepcopy(saved["optimizer"][0]))
        source = 0 if offset is None else (t.rank + offset) % t.size
        optimizer.load_compression_state_dict(copy.deepcopy(saved["compression"][source]))
        optimizer.zero_grad()
        _backward(model, t.rank, 3)
        with pytest.raises(ValueError) as raised:
            optimizer.step()
        return str(raised.value)

    for message in run_local(3, resume):
        assert expected in message and "load each rank's own" in message


def test_a_compression_state_saved_before_states_named_their_rank_resumes_as_before():
    saved = _saved()
    for state in saved["compression"]:
        del state["grace"]["rank"]
    assert run_local(3, _resumed, saved, 0) == [None] * 3


def test_an_optimizer_resumed_without_its_compression_state_warns_once_per_rank():
    """The optimizer's state came back and the compression state did not: the residuals start
    afresh, which used to pass in silence. Resumed with both, started fresh, or after
    Horovod's state-creating step on zero gradients (a fresh run's hvd.broadcast_optimizer_state),
    or with the optimizer wrapped anew after steps through an earlier wrapper (whose steps
    were the base optimizer's too: it warned), nothing is said."""
    saved = _saved()

    def creating_state_first(t):
        model, optimizer = _trained(t, 0)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()  # creates the state, synchronises nothing
        _trained_step(model, optimizer, t.rank)

    def fresh(t):
        _trained(t, 2)

    def created_before_wrapping(t):  # Horovod's MNIST example broadcasts before it wraps
        model = _model(0)
        adam = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=1e-3)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        adam.step()  # hvd.broadcast_optimizer_state's step: Adam's step count is 1 now
        optimizer = spardl_grace.DistributedOptimizer(
            adam, grace_from_params(PARAMS, transport=t), named_parameters=model.named_parameters())
        _trained_step(model, optimizer, t.rank)

    def wrapped_again(t):  # a second phase of the run wraps the same optimizer anew
        _wrapped_twice(t, carry=True)

    cases = {"afresh": (_resumed, saved, None), "both": (_resumed, saved, 0),
             "fresh": (fresh,), "created": (creating_state_first,),
             "created before wrapping": (created_before_wrapping,),
             "wrapped again": (wrapped_again,)}
    said = {}
    for case, (fn, *args) in cases.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_local(3, fn, *args)
        said[case] = _library_warnings(caught)
    assert len(said["afresh"]) == 3
    assert all("compression state was not restored" in m for m in said["afresh"])
    assert said["both"] == said["fresh"] == said["created"] == []
    assert said["created before wrapping"] == []
    assert len(said["wrapped again"]) == 3 and all("takes over" in m for m in said["wrapped again"])


def _library_warnings(caught) -> list[str]:
    """The library's warnings in `caught`, bar the one for Adam on SparDL's gradient
    (spardl_grace.adam_advice): these tests take Adam for the state it keeps."""
    return [str(w.message) for w in caught
            if "spardl_grace" in str(w.message) and " steps on " not in str(w.message)]


def _wrapped_twice(t, carry: bool, second_at: int = 2, steps: int = 4):
    """Adam through a DistributedOptimizer, wrapped again after `second_at` of `steps` steps
    (with the first one's compression state carried over); the model and both wrappers."""
    model = _model(0)
    adam = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=1e-3)
    wrappers = []
    for step in range(steps):
        if step in (0, second_at):
            wrappers.append(spardl_grace.DistributedOptimizer(
                adam, grace_from_params(PARAMS, transport=t),
                named_parameters=model.named_parameters()))
            if carry and len(wrappers) == 2:
                wrappers[1].load_compression_state_dict(wrappers[0].compression_state_dict())
        optimizer = wrappers[-1]
        optimizer.zero_grad()
        _backward(model, t.rank, step)
        optimizer.step()
    return model, wrappers


def test_a_second_wrapper_over_the_same_optimizer_takes_its_parameters_over():
    """Both wrappers' gradient hooks fired, so each step's buckets were launched twice and the
    ranks ran different sequences of operations. Now the later one takes over (a warning
    says the residuals stay with the earlier, whose step() raises), and with them carried
    over the run equals one wrapper's, bit for bit."""
    def fn(t):
        model, (first, _) = _wrapped_twice(t, carry=True)
        errors = []
        for call in (first.step, first.synchronize):
            try:
                call()
            except RuntimeError as exc:
                errors.append(str(exc))
        straight, _ = _wrapped_twice(t, carry=True, second_at=99)
        return (torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                torch.cat([p.detach().reshape(-1) for p in straight.parameters()]),
                errors)

    with warnings.catch_warnings(record=True) as caught:  # the ranks' threads warn here
        warnings.simplefilter("always")
        results = run_local(3, fn)
    for twice, once, errors in results:
        assert torch.equal(twice, once)
        assert len(errors) == 2 and all("a later DistributedOptimizer" in e for e in errors)
    said = _library_warnings(caught)
    assert len(said) == 3 and all("load_compression_state_dict" in m for m in said)


def _trained_step(model, optimizer, rank: int) -> None:
    optimizer.zero_grad()
    _backward(model, rank, 0)
    optimizer.step()


def test_residuals_are_keyed_by_names_without_the_wrappers_of_compile_or_checkpointing():
    """A compiled model names its parameters '_orig_mod.NAME', a checkpoint-wrapped module
    'NAME._checkpoint_wrapped_module.weight'; torch's own state dicts leave those segments
    out, and so does the compression state now: saved from a compiled model's optimizer, it
    resumes an uncompiled one bit for bit, the density warm-up's position and SparDL's
    schedule included (before, none of it carried over, in silence). A state saved before,
    under the prefixed names, brings its residuals over."""
    from spardl_grace.sync import stable_name
    assert stable_name("_orig_mod.blocks.0._checkpoint_wrapped_module.attn.weight") == (
        "blocks.0.attn.weight")
    params = {**PARAMS, "compress_ratio": 0.05, "min_entries": 0, "density_warmup_steps": 8}

    def run(t, prefix: str, steps: range, state=None):
        model = _model(0)
        if state is not None:
            model.load_state_dict(state["model"])
        optimizer = spardl_grace.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            grace_from_params(params, transport=t),
            named_parameters=[(prefix + n, p) for n, p in model.named_parameters()])
        if state is not None:
            optimizer.load_state_dict(state["optimizer"])
            optimizer.load_compression_state_dict(state["compression"])
        for step in steps:
            optimizer.zero_grad()
            _backward(model, t.rank, step)
            optimizer.step()
        return {"model": copy.deepcopy(model.state_dict()),
                "optimizer": copy.deepcopy(optimizer.state_dict()),
                "compression": copy.deepcopy(optimizer.compression_state_dict())}

    def compiled_then_not(t):
        first = run(t, "_orig_mod.", range(3))
        residuals = sorted(first["compression"]["grace"]["memory"]["residuals"])
        resumed, unbroken = run(t, "", range(3, 6), first), run(t, "", range(6))
        afresh = run(t, "", range(3, 6), {**first, "compression": run(t, "", range(0))["compression"]})
        return residuals, resumed["model"], unbroken["model"], afresh["model"]

    for residuals, resumed, unbroken, afresh in run_local(3, compiled_then_not):
        assert residuals == ["0.weight", "2.weight"]
        assert all(torch.equal(resumed[k], unbroken[k]) for k in unbroken)
        assert not all(torch.equal(afresh[k], unbroken[k]) for k in unbroken)
    saved = _saved()

    def old_names(t):
        _, optimizer = _trained(t, 0)
        state = copy.deepcopy(saved["compression"][t.rank])
        residuals = state["grace"]["memory"]["residuals"]
        state["grace"]["memory"]["residuals"] = {f"_orig_mod.{n}": v for n, v in residuals.items()}
        optimizer.load_compression_state_dict(state)
        loaded = optimizer.compression_state_dict()["grace"]["memory"]["residuals"]
        return all(torch.equal(loaded[n], v) for n, v in residuals.items())

    assert all(run_local(3, old_names))


def test_a_frozen_parameters_residual_resumes_and_each_step_counts_once():
    """A layer frozen after the save (staged fine-tuning) kept a residual the resume refused
    as a parameter 'this model does not have'; and a DistributedOptimizer's step, which calls
    its optimizer class's, counted twice toward the steps that explain its state."""
    from spardl_grace.step_hooks import steps_taken
    saved = _saved()

    def frozen(t):
        model = _model(0)
        model[0].weight.requires_grad_(False)
        optimizer = spardl_grace.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), grace_from_params(PARAMS, transport=t),
            named_parameters=model.named_parameters())
        optimizer.load_compression_state_dict(copy.deepcopy(saved["compression"][t.rank]))
        _, counted = _trained(t, 3)
        return steps_taken(counted)

    assert run_local(3, frozen) == [3] * 3


def test_a_compression_state_of_other_parameter_names_is_refused_and_the_state_kept():
    saved = _saved()

    def load_renamed(t):
        _, optimizer = _trained(t, 1)
        before = copy.deepcopy(optimizer.compression_state_dict())
        state = copy.deepcopy(saved["compression"][t.rank])
        residuals = state["grace"]["memory"]["residuals"]
        state["grace"]["memory"]["residuals"] = {f"encoder.{n}": v for n, v in residuals.items()}
        with pytest.raises(ValueError, match="parameters this model does not have") as raised:
            optimizer.load_compression_state_dict(state)
        return str(raised.value), same_state(optimizer.compression_state_dict(), before)

    for message, kept in run_local(3, load_renamed):
        assert "'encoder.0.weight'" in message and kept
