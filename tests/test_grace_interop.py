"""GRACE and DeepReduce users' own compressors and memories (tests/grace_style.py: GRACE's
interface only) over this library's communicators and DistributedOptimizer, on threads and
under torchrun; GRACE's constructor signatures; grace_dl's ABCs; refusals that say why."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import grace_style as gs
from spardl_grace import grace_from_params
from spardl_grace.transport import run_local
from spardl_grace.communicators.spardl import SparDL
from spardl_grace.memories.residual import GlobalResidualMemory

ROOT = Path(__file__).resolve().parent.parent


def check_pairs(per_rank: list[dict]) -> None:
    """Identical results on every rank; the exact average where the compressor is lossless."""
    for label in per_rank[0]:
        for step in range(3):
            results = [r[label]["results"][step] for r in per_rank]
            for rank, result in enumerate(results):
                assert torch.equal(result, results[0]), f"{label}: rank {rank} differs"
            if per_rank[0][label]["lossless"]:
                inputs = [r[label]["inputs"][step] for r in per_rank]
                assert torch.allclose(results[0], sum(inputs) / len(inputs), atol=1e-6), label
            assert results[0].shape == (6, 50)


def test_grace_users_compressors_and_memories_over_every_communicator_on_threads():
    check_pairs(run_local(3, gs.run_pairs))


def test_the_same_under_torchrun_with_graces_constructors(launch):
    """Allgather(compressor, memory, world_size) as GRACE builds them: the active backend's
    transport (gloo under torchrun)."""
    check_pairs(launch("gloo", 3, "grace_style.with_grace_constructors"))


def test_graces_horovod_flavour_under_horovodrun(launch):
    """Allgather(compressor, memory), as grace_dl.torch builds them for Horovod, with
    send_step / receive_step: Horovod's transport, identical replicas, exact lossless averages."""
    per_rank = launch("horovod-gloo", 2, "grace_style.horovod_flavour")
    check_pairs(per_rank)
    assert {r[label]["transport"] for r in per_rank for label in r} == {"HorovodTransport"}


def test_grace_constructor_world_size_must_match_the_backend(launch):
    with pytest.raises(AssertionError, match="world_size 5 does not match the active backend's 2"):
        launch("gloo", 2, "grace_style.wrong_world_size")


def test_graces_dist_broadcast_takes_its_rank_and_refuses_another():
    """grace_dl.dist's Broadcast(compressor, memory, world_size, rank) raised TypeError; the
    rank must be this process's."""
    from spardl_grace.communicators.grace import Broadcast

    def fn(t):
        Broadcast(gs.PlainNone(), gs.PlainNoneMemory(), t, t.rank)
        with pytest.raises(ValueError, match="pass dist.get_rank"):
            Broadcast(gs.PlainNone(), gs.PlainNoneMemory(), t, (t.rank + 1) % t.size)
    run_local(2, fn)


def check_training(per_rank: list[dict]) -> None:
    for r in per_rank:
        assert torch.equal(r["params"], per_rank[0]["params"])
        assert r["losses"][-5:].mean() < 0.8 * r["losses"][:5].mean()
        # compressed one parameter at a time, as GRACE does: a residual under each name
        assert r["residual_names"] == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_a_grace_users_compressor_trains_through_distributed_optimizer():
    check_training(run_local(3, gs.training))


#: GRACE's communicators with compressors whose result depends on the tensor's shape or its
#: own statistics (PowerSGD's matrix, QSGD's norm, one-bit's scale, top-k's selection)
PER_TENSOR = [("powersgd", "powersgd", "allreduce"), ("qsgd", "none", "allgather"),
              ("onebit", "residual", "allgather"), ("topk", "residual", "allgather"),
              ("randomk", "residual", "allreduce"), ("terngrad", "none", "broadcast")]


@pytest.mark.parametrize("compressor, memory, communicator", PER_TENSOR)
def test_grace_communicators_compress_each_parameter_in_its_shape_as_graces_loop_does(
        compressor, memory, communicator):
    """DistributedOptimizer fuses the model into one bucket, and a GRACE compressor was handed
    that flat bucket: PowerSGD, which compresses matrices, sent everything uncompressed, and
    QSGD took one norm for the whole model. Each parameter is now compressed on its own, in
    its shape, under its name: the bits of GRACE's loop (grc.step per gradient), and the
    bytes sent are counted (last_stats was empty)."""
    import scenarios
    from spardl_grace import DistributedOptimizer
    params = {"compressor": compressor, "memory": memory, "communicator": communicator,
              "compress_ratio": 0.3}

    def fn(t):
        loop = scenarios.train_tiny(grace_from_params(dict(params), transport=t), t.rank)
        model, batches = scenarios.tiny_regression(t.rank)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   grace_from_params(dict(params), transport=t),
                                   named_parameters=model.named_parameters())
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return loop, [p.detach().clone() for p in model.parameters()], opt.last_stats

    dense_bytes = (8 * 6 + 6 + 6 + 1) * 4  # what one rank's fp32 gradient holds
    for loop, fused, stats in run_local(2, fn):
        for a, b in zip(loop, fused):
            assert torch.equal(a, b)
        assert 0 < stats["bytes_sent"]
        if compressor == "powersgd":  # rank 1 of the 6 x 8 matrix: 14 entries for 48
            assert stats["bytes_sent"] < dense_bytes


def test_a_grace_users_compressor_trains_through_the_ddp_hook(launch):
    check_training(launch("gloo", 3, "grace_style.ddp_training"))


def test_grace_from_params_takes_objects_and_checks_the_rest():
    def fn(t):
        grc = grace_from_params({"compressor": gs.PlainTopK(0.1), "memory": gs.PlainResidual(),
                                 "communicator": "allgather"}, transport=t)
        return type(grc).__name__, type(grc.compressor).__name__, grc.state_dict()["compressor"]
    assert run_local(2, fn)[0] == ("Allgather", "PlainTopK", {})  # no state_dict: not saved
    # an object beside the name of its partner stands in as that partner (efsignsgd's pair)
    from spardl_grace.compressors.efsignsgd import EFSignSGDCompressor
    from spardl_grace.memories.efsignsgd import EFSignSGDMemory
    for pair in ({"compressor": "efsignsgd", "memory": EFSignSGDMemory(0.1)},
                 {"compressor": EFSignSGDCompressor(0.1), "memory": "efsignsgd"}):
        built = run_local(2, lambda t, pair=pair: type(grace_from_params(
            {**pair, "communicator": "allgather"}, transport=t).memory).__name__)
        assert built == ["EFSignSGDMemory"] * 2
    with pytest.raises(ValueError, match="unknown communicator 'ring'"):
        run_local(2, lambda t: grace_from_params({"compressor": gs.PlainNone(), "communicator": "ring"},
                                                 transport=t))


def test_sparse_allreduces_refuse_what_they_would_ignore():
    """SparDL selects by itself: a foreign compressor would be silently ignored, and a memory
    without store_residual could not take the residual. Both are refused, saying why."""
    def foreign_compressor(t):
        grace_from_params({"compressor": gs.PlainTopK(0.1), "communicator": "spardl",
                           "memory": "global_residual"}, transport=t)
    with pytest.raises(ValueError, match="selects its entries itself.*PlainTopK.*'allgather'"):
        run_local(2, foreign_compressor)

    def own_compressor(t, compressor):
        grc = grace_from_params({"compressor": compressor, "communicator": "spardl",
                                 "memory": "global_residual"}, transport=t)
        return hasattr(grc, "compressor")
    from spardl_grace.compressors import RandomKCompressor, TopKCompressor
    assert run_local(2, own_compressor, TopKCompressor(0.1)) == [False, False]  # GRACE's config
    with pytest.raises(ValueError, match="ignore the compressor RandomKCompressor"):
        run_local(2, own_compressor, RandomKCompressor(0.1))

    def dense_with(t, compressor):
        return type(grace_from_params({"compressor": compressor, "communicator": "dense",
                                       "memory": "none"}, transport=t)).__name__
    from spardl_grace.compressors import NoneCompressor
    assert run_local(2, dense_with, NoneCompressor()) == ["Dense", "Dense"]
    with pytest.raises(ValueError, match="dense sends the uncompressed gradient, so it would "
                                         "ignore the compressor RandomKCompressor.*'none' or 'topk'"):
        run_local(2, dense_with, RandomKCompressor(0.1))

    def foreign_memory(t):
        SparDL(gs.PlainResidual(), t, 0.1)
    with pytest.raises(ValueError, match="store_residual.*PlainResidual lacks"):
        run_local(2, foreign_memory)


def test_objects_without_graces_methods_are_refused_by_name():
    from spardl_grace.communicators.grace import Allgather

    def fn(t):
        Allgather(object(), GlobalResidualMemory(), t)
    with pytest.raises(TypeError, match="the compressor object lacks compress, decompress"):
        run_local(2, fn)


def test_registered_as_virtual_subclasses_of_grace_dls_abcs(tmp_path):
    """With a grace_dl on the path (a stand-in with GRACE's module layout and ABC names),
    isinstance checks in a GRACE user's code pass for this library's objects."""
    for module in ("dist", "torch"):
        package = tmp_path / "grace_dl" / module
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(textwrap.dedent("""
            from abc import ABC, abstractmethod
            class Compressor(ABC):
                @abstractmethod
                def compress(self, tensor, name): ...
            class Memory(ABC):
                @abstractmethod
                def compensate(self, tensor, name): ...
            class Communicator(ABC):
                pass
            """))
    (tmp_path / "grace_dl" / "__init__.py").write_text("")
    script = textwrap.dedent("""
        import grace_dl.dist, grace_dl.torch
        from spardl_grace import grace_from_params
        from spardl_grace.transport import run_local
        def fn(t):
            grc = grace_from_params({'compressor': 'topk', 'memory': 'residual',
                                     'communicator': 'allgather'}, transport=t)
            sparse = grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                                        'communicator': 'spardl'}, transport=t)
            return [isinstance(grc.compressor, m.Compressor) and isinstance(grc.memory, m.Memory)
                    and isinstance(grc, m.Communicator) and isinstance(sparse, m.Communicator)
                    for m in (grace_dl.dist, grace_dl.torch)]
        print(run_local(2, fn)[0])
        """)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[True, True]"
