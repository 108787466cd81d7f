"""Crash-safe checkpoints: atomic writes, the previous checkpoint as a fallback, and ranks that
loaded different steps refusing together."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from spardl_grace.checkpoint import (check_same_step, load_agreed_checkpoint, load_checkpoint,
                                     previous_path, save_checkpoint)
from spardl_grace.transport import run_local

ROOT = Path(__file__).resolve().parent.parent


def test_a_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"step": 1}, path)
    assert not previous_path(path).exists()
    save_checkpoint({"step": 2}, path)
    assert load_checkpoint(path) == ({"step": 2}, path)
    assert torch.load(previous_path(path), weights_only=True) == {"step": 1}
    assert not list(tmp_path.glob("*.tmp"))


def test_a_torn_checkpoint_falls_back_to_the_previous_one(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"step": 1, "w": torch.arange(1000)}, path)
    save_checkpoint({"step": 2, "w": torch.arange(1000)}, path)
    path.write_bytes(path.read_bytes()[:300])  # what a crash mid-write would leave without rename
    state, source = load_checkpoint(path)
    assert state["step"] == 1 and source == previous_path(path)
    path.unlink()
    assert load_checkpoint(path)[0]["step"] == 1


def test_no_loadable_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "ckpt.pt"
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(path)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="no checkpoint could be loaded"):
        load_checkpoint(path)


def test_a_failed_save_leaves_the_last_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"step": 1}, path)

    def crash(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path) == ({"step": 1}, path)


def test_a_state_that_would_not_load_back_is_refused_and_nothing_is_written(tmp_path):
    """An argparse.Namespace or a numpy number in the state was saved, and every resume then
    read no checkpoint and started afresh, over it (the next saves pushed it out)."""
    import argparse

    import numpy as np
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"step": 1}, path)
    for bad in (argparse.Namespace(lr=0.1), np.float64(0.91)):
        with pytest.raises(ValueError, match="would not load back .* Nothing was written: keep "
                                             "tensors, numbers"):
            save_checkpoint({"step": 2, "extra": bad}, path)
        assert load_checkpoint(path) == ({"step": 1}, path) and not previous_path(path).exists()
        assert not list(tmp_path.glob("*.tmp"))


WRITER = textwrap.dedent("""
    import sys, torch
    from spardl_grace.checkpoint import save_checkpoint
    for version in range(10**6):
        save_checkpoint({"version": version, "data": torch.full((2_000_000,), version)}, sys.argv[1])
""")


def test_kill_9_during_saves_always_leaves_a_complete_checkpoint(tmp_path):
    """A real crash: SIGKILL a process that saves 8 MB checkpoints back to back, at random
    moments; what loads afterwards is always one whole version."""
    rng = random.Random(0)
    path = tmp_path / "ckpt.pt"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for trial in range(3):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=env)
        deadline = time.monotonic() + 60
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.05, 0.5))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        state, _ = load_checkpoint(path)
        assert torch.equal(state["data"], torch.full((2_000_000,), state["version"]))


def _agree(transport, steps, runs):
    try:
        check_same_step(transport, steps[transport.rank], runs[transport.rank])
        return "ok"
    except ValueError as exc:
        return str(exc)


def test_ranks_that_loaded_the_same_step_go_on():
    assert run_local(3, _agree, [7, 7, 7], ["run-a"] * 3) == ["ok"] * 3


def test_ranks_that_loaded_different_steps_all_refuse():
    messages = run_local(3, _agree, [7, 5, 7], ["run-a"] * 3)
    assert len(set(messages)) == 1
    assert "different steps: [7, 5, 7]" in messages[0]


def test_ranks_with_another_runs_checkpoint_all_refuse():
    messages = run_local(3, _agree, [7, 7, 7], ["run-a", "run-a", "run-b"])
    assert len(set(messages)) == 1
    assert "different runs: ranks [2]" in messages[0]


def _resume(transport, directory, saves):
    """Rank r saves the steps saves[r] in order (the last newest, the one before kept as
    .prev), then every rank asks for the newest checkpoint they all hold."""
    Path(directory).mkdir(exist_ok=True)
    path = Path(directory) / f"ckpt-rank{transport.rank}.pt"
    for step, run in saves[transport.rank]:
        save_checkpoint({"step": step, "run_id": run, "w": torch.full((3,), float(step))}, path)
    try:
        found = load_agreed_checkpoint(transport, path)
    except ValueError as exc:
        return str(exc)
    return None if found is None else (found[0]["step"], found[0]["w"][0].item(), found[1].name)


def test_resume_auto_starts_fresh_when_no_rank_holds_a_checkpoint(tmp_path):
    assert run_local(3, _resume, tmp_path, [[], [], []]) == [None] * 3


def test_resume_takes_the_newest_step_every_rank_holds(tmp_path):
    """A crash during rank 1's save at step 20 left it at step 10: every rank takes 10, the
    others from their previous file."""
    saves = [[(10, "a"), (20, "a")], [(0, "a"), (10, "a")], [(10, "a"), (20, "a")]]
    assert run_local(3, _resume, tmp_path, saves) == [
        (10, 10.0, "ckpt-rank0.pt.prev"), (10, 10.0, "ckpt-rank1.pt"), (10, 10.0, "ckpt-rank2.pt.prev")]
    same = [[(10, "a"), (20, "a")]] * 3
    assert run_local(3, _resume, tmp_path / "same", same) == [(20, 20.0, f"ckpt-rank{r}.pt")
                                                             for r in range(3)]


@pytest.mark.parametrize("saves,message", [
    ([[(10, "a")], [], [(10, "a")]], "ranks [1] hold no checkpoint"),
    ([[(10, "a"), (20, "a")], [(30, "a"), (40, "a")], [(10, "a"), (20, "a")]],
     "share no checkpoint step (steps by rank: [[10, 20], [30, 40], [10, 20]]"),
    ([[(10, "a")], [(10, "b")], [(10, "a")]], "share no checkpoint step")])
def test_ranks_without_a_shared_checkpoint_all_refuse_to_resume(tmp_path, saves, message):
    got = run_local(3, _resume, tmp_path, saves)
    assert len(set(got)) == 1 and message in got[0], got


def _resume_over_files(transport, directory, newest: bytes | None, previous: bytes | None):
    """_resume's ask, with rank 1's files replaced by `newest` and `previous` (bytes; None:
    the saved one stays)."""
    Path(directory).mkdir(exist_ok=True)
    path = Path(directory) / f"ckpt-rank{transport.rank}.pt"
    for step in (10, 20):
        save_checkpoint({"step": step, "run_id": "a", "w": torch.full((3,), float(step))}, path)
    if transport.rank == 1:
        for file, content in ((path, newest), (previous_path(path), previous)):
            if content is not None:
                file.write_bytes(content)
    transport.barrier("files.written")
    try:
        found = load_agreed_checkpoint(transport, path)
    except ValueError as exc:
        return str(exc)
    return None if found is None else (found[0]["step"], found[1].name)


def test_checkpoint_files_that_do_not_load_are_refused_on_every_rank_not_started_over(tmp_path):
    """Files that do not load counted as none: ranks without another started afresh (or,
    when only some did, every rank said they 'hold no checkpoint', hiding why)."""
    got = run_local(3, _resume_over_files, tmp_path, b"not a checkpoint", b"nor this")
    assert all("ranks [1] hold checkpoint files" in g and "do not load" in g for g in got), got
    assert "UnpicklingError" in got[1] or "RuntimeError" in got[1]  # rank 1 says why
    with pytest.warns(RuntimeWarning, match="does not load, resuming from the other"):
        # the newest unreadable beside a readable previous: every rank takes the shared step
        assert run_local(3, _resume_over_files, tmp_path / "one", b"torn", None) == [
            (10, "ckpt-rank0.pt.prev"), (10, "ckpt-rank1.pt.prev"), (10, "ckpt-rank2.pt.prev")]


# The sparse all-reduces' state dicts held a 'compressor' entry (an unused top-k compressor's
# state) until they became peers of GRACE's communicators instead of subclasses; the fixture is
# what the code before that change saved (4 ranks, after 3 steps) and its next step's result.
OLD_STATES = Path(__file__).parent / "data" / "sparse_allreduce_states_before_peer_bases.pt"
OLD_CONFIGS = {"spardl": {"communicator": "spardl", "teams": 2},
               "oktopk": {"communicator": "oktopk", "oktopk_threshold_interval": 2},
               "gtopk": {"communicator": "gtopk"}}


@pytest.mark.parametrize("comm", sorted(OLD_CONFIGS))
def test_sparse_allreduce_checkpoints_from_before_the_peer_bases_resume_bit_identically(comm):
    from spardl_grace import grace_from_params
    saved = torch.load(OLD_STATES, weights_only=True)[comm]
    assert "compressor" in saved["states"][0]  # the old layout

    def fn(t):
        # The code that saved them had no floor on the entries sent and sent the exact wire:
        # min_entries 0 and wire 'exact' continue them as they were (the CHANGELOG says so).
        grc = grace_from_params({"compressor": "topk", "memory": "global_residual",
                                 "compress_ratio": 0.1, "min_entries": 0, "wire": "exact",
                                 **OLD_CONFIGS[comm]},
                                transport=t)
        grc.load_state_dict(saved["states"][t.rank])
        g = torch.Generator().manual_seed(t.rank)
        grads = [torch.randn(200, generator=g) for _ in range(4)]
        return grc.step(grads[3], "w"), grc.state_dict()
    for result, state in run_local(4, fn):
        assert torch.equal(result, saved["next"])
        assert "compressor" not in state
