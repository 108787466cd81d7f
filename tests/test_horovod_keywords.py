"""Horovod 0.28's DistributedOptimizer keywords on spardl_grace.DistributedOptimizer, with
Horovod's meaning (spardl_grace.horovod_compat). Ranks are threads (run_local) with Horovod's
own constants (hvd.Average, hvd.Compression.fp16: importable without horovodrun); the scripts
that change nothing but the optimizer's name run under horovodrun in test_examples."""
from __future__ import annotations

import pytest
import torch

import training_scenarios as ts
from spardl_grace import DistributedOptimizer, grace_from_params
from spardl_grace.transport import run_local

hvd = pytest.importorskip("horovod.torch")

SPARDL = {"compressor": "topk", "memory": "global_residual", "communicator": "spardl",
          "compress_ratio": 0.1}


def _grads_after(t, params: dict | None = None, **kwargs) -> list[torch.Tensor]:
    """The gradients step() would apply after one backward pass, with these keywords."""
    model = ts.mlp()
    grc = grace_from_params(params or SPARDL, transport=t)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grc,
                                     named_parameters=model.named_parameters(), **kwargs)
    x, y = next(iter(ts.batches(t.rank, t.size, 1)))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.synchronize()
    return [p.grad.clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_op_sum_is_the_average_times_the_ranks():
    def fn(t):
        average = _grads_after(t, op=hvd.Average)
        total = _grads_after(t, op=hvd.Sum)
        return _same(total, [g * t.size for g in average]), _same(average, _grads_after(t))

    assert run_local(3, fn) == [(True, True)] * 3


def test_gradient_predivide_factor_splits_the_average_as_horovod_does():
    """Gradients times 1/f before, f after: with f = 2 every scaling is exact in binary and
    top-k's choice does not change, so the result is the plain average's, bit for bit."""
    def fn(t):
        return _same(_grads_after(t, gradient_predivide_factor=2.0), _grads_after(t))

    assert all(run_local(3, fn))


@pytest.mark.parametrize("kwargs,match", [
    ({"op": hvd.Adasum}, "op=Adasum is not supported.*hvd.Average and hvd.Sum"),
    ({"op": hvd.Max}, "op=Max is not supported"),
    ({"op": "mean"}, "op='mean' is not supported"),
    ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "op != Average"),
    ({"gradient_predivide_factor": 0}, "gradient_predivide_factor must be > 0"),
    ({"compression": "topk"}, "Compression.none or Compression.fp16"),
    ({"compression": hvd.Compression.fp16, "params": {**SPARDL, "wire": "exact"}},
     "'wire': 'compact'"),
    ({"compression": hvd.Compression.fp16, "params": {"communicator": "auto"}},
     "leave it out of 'auto_candidates'"),
    ({"process_set": hvd.ProcessSet([0])}, "only the global process set"),
    ({"groups": 0}, "groups should be a positive integer"),
    ({"groups": [[torch.zeros(3)]]}, "not a parameter of the optimizer"),
    ({"groups": 2, "bucket_cap_mb": 1}, "not both"),
])
def test_bad_horovod_keywords_name_the_valid_choices(kwargs, match):
    def fn(t):
        with pytest.raises(ValueError, match=match):
            _grads_after(t, **kwargs)
        return True

    assert all(run_local(1, fn))


def test_fp16_compression_sends_16_bit_values_on_the_compact_wire():
    """With 'wire': 'compact', Compression.fp16 is accepted; the bytes are the compact
    wire's (fewer than Compression.none with the exact wire)."""
    def fn(t):
        sent = {}
        for wire, compression in (("exact", hvd.Compression.none),
                                  ("compact", hvd.Compression.fp16)):
            model = ts.mlp()
            grc = grace_from_params({**SPARDL, "wire": wire}, transport=t)
            optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grc,
                                             named_parameters=model.named_parameters(),
                                             compression=compression)
            x, y = next(iter(ts.batches(t.rank, t.size, 1)))
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            sent[wire] = optimizer.last_stats["bytes_sent"]
        return sent["compact"] < 0.8 * sent["exact"]

    assert all(run_local(2, fn))


def test_fp16_compression_with_auto_whose_candidates_all_send_16_bit_values():
    """Horovod's MNIST example turns fp16 on: 'auto' refused it, advising a 'wire' that 'auto'
    refuses too; without float32 dense among its candidates every choice sends 16-bit values."""
    candidates = ["dense16", "spardl@0.1", "spardl@0.01"]

    def fn(t):
        return len(_grads_after(t, {"communicator": "auto", "auto_candidates": candidates},
                                compression=hvd.Compression.fp16))

    assert run_local(2, fn) == [4, 4]


def test_fp16_compression_with_graces_fp16_compressor():
    def fn(t):
        return len(_grads_after(t, {"compressor": "fp16", "memory": "none",
                                    "communicator": "allreduce"},
                                compression=hvd.Compression.fp16))

    assert run_local(2, fn) == [4, 4]


def _buckets(t, model=None, **kwargs) -> list[tuple[str, ...]]:
    model = model or ts.mlp()
    grc = grace_from_params(SPARDL, transport=t)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grc,
                                     named_parameters=model.named_parameters(), **kwargs)
    return [b.names for b in optimizer.buckets]


def test_groups_become_buckets():
    """An int cuts the parameters (optimizer order) into near-equal runs, as Horovod's
    split_list; lists are taken as they are and every other parameter is a bucket of its own;
    num_groups is the deprecated int form. Buckets go in backward's order."""
    def fn(t):
        model = ts.mlp()
        w0, b0, w1, b1 = model.parameters()
        return (_buckets(t, groups=2), _buckets(t, num_groups=2), _buckets(t, groups=3),
                _buckets(t), _buckets(t, model, groups=[[w1, b0]]))

    two, deprecated, three, default, listed = run_local(1, fn)[0]
    assert two == deprecated == [("2.bias", "2.weight"), ("0.bias", "0.weight")]
    assert three == [("2.bias",), ("2.weight",), ("0.bias", "0.weight")]
    assert default == [("2.bias", "2.weight", "0.bias", "0.weight")]
    assert listed == [("2.bias",), ("2.weight", "0.bias"), ("0.weight",)]


def test_groups_train_every_rank_to_the_same_model():
    def fn(t):
        model = ts.mlp()
        grc = grace_from_params(SPARDL, transport=t)
        optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grc,
                                         named_parameters=model.named_parameters(), groups=2)
        ts.train(model, optimizer, t.rank, t.size, 5)
        return ts.flat_params(model)

    results = run_local(3, fn)
    assert all(torch.equal(r, results[0]) for r in results)


class _Bag(torch.nn.Module):
    """An embedding with sparse gradients and a dense head."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.embedding = torch.nn.Embedding(50, 8, sparse=True)
        self.head = torch.nn.Linear(8, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, tokens):
        return self.head(self.embedding(tokens).mean(1))


def _sparse_step(t, sparse_as_dense: bool):
    model = _Bag()
    grc = grace_from_params({**SPARDL, "compress_ratio": 1.0, "wire": "exact"}, transport=t)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grc,
                                     named_parameters=model.named_parameters(),
                                     sparse_as_dense=sparse_as_dense)
    g = torch.Generator().manual_seed(t.rank)
    tokens, y = torch.randint(0, 50, (4, 6), generator=g), torch.randint(0, 3, (4,), generator=g)
    torch.nn.functional.cross_entropy(model(tokens), y).backward()
    local = model.embedding.weight.grad.to_dense().clone()
    optimizer.synchronize()
    return local, model.embedding.weight.grad


def test_sparse_as_dense_synchronises_sparse_gradients_and_gives_them_back_sparse():
    """At density 1 the result is the exact average of the ranks' embedding gradients; it is
    handed back sparse, as Horovod does."""
    results = run_local(2, _sparse_step, True)
    average = (results[0][0] + results[1][0]) / 2
    for _, grad in results:
        assert grad.is_sparse
        assert torch.allclose(grad.to_dense(), average, atol=1e-7)


def test_sparse_gradients_without_sparse_as_dense_are_refused():
    def fn(t):
        with pytest.raises(ValueError, match="sparse_as_dense=True"):
            _sparse_step(t, False)
        return True

    assert all(run_local(1, fn))


def test_graces_and_horovods_positional_forms():
    """DistributedOptimizer(opt, grc, named_parameters=...) and grace=grc build the same
    buckets; Horovod's DistributedOptimizer(opt, model.named_parameters()) takes the second
    argument as the names and builds the default communicator on the active backend (none
    here, with threads: the error says so, not that the argument is wrong)."""
    from spardl_grace.transport import TransportError

    def fn(t):
        forms = []
        for form in ("grace", "keyword"):
            model = ts.mlp()
            grc = grace_from_params(SPARDL, transport=t)
            sgd = torch.optim.SGD(model.parameters(), lr=0.1)
            if form == "grace":
                opt = DistributedOptimizer(sgd, grc, named_parameters=model.named_parameters())
            else:
                opt = DistributedOptimizer(sgd, grace=grc, named_parameters=model.named_parameters())
            forms.append(opt.buckets)
        model = ts.mlp()
        with pytest.raises(TransportError, match="no communication backend is active"):
            DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 model.named_parameters())
        return forms

    forms = run_local(1, fn)[0]
    assert forms[0] == forms[1]
