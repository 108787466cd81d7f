"""Every GRACE compressor: round trips, what it sends, determinism of shared randomness."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from spardl_grace import compressors as C
from spardl_grace.selection import count_for_ratio
from spardl_grace.compressors.signsgd import majority_vote
from spardl_grace.transport import run_local


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def roundtrip(comp, x, name="w"):
    tensors, ctx = comp.compress(x, name)
    return tensors, comp.decompress(tensors, ctx)


def test_none_and_fp16():
    x = randn(4, 5)
    _, y = roundtrip(C.NoneCompressor(), x)
    assert torch.equal(y, x)
    tensors, y = roundtrip(C.FP16Compressor(), x)
    assert tensors[0].dtype == torch.float16
    assert y.dtype == x.dtype and torch.equal(y, x.half().float())


@pytest.mark.parametrize("numel,ratio", [(1, 0.01), (10, 0.3), (1000, 0.01), (7, 1.0)])
def test_topk_keeps_exactly_the_largest(numel, ratio):
    x = randn(numel, seed=numel)
    tensors, y = roundtrip(C.TopKCompressor(ratio), x)
    k = count_for_ratio(numel, ratio)
    assert tensors[0].numel() == k
    kept = y != 0
    assert int(kept.sum()) == k
    assert torch.equal(y[kept], x[kept])
    if k < numel:
        assert x[kept].abs().min() >= x[~kept].abs().max()


def test_randomk_positions_are_shared_and_change_each_step():
    x = randn(100)
    a, b = C.RandomKCompressor(0.1), C.RandomKCompressor(0.1)
    _, ctx_a = a.compress(x, "w")
    _, ctx_b = b.compress(x * 2, "w")
    assert torch.equal(ctx_a[0], ctx_b[0])  # two "ranks" agree without exchanging indices
    _, ctx_next = a.compress(x, "w")
    assert not torch.equal(ctx_a[0], ctx_next[0])
    state = torch.get_rng_state()
    _, y = roundtrip(C.RandomKCompressor(0.1), x)
    assert torch.equal(torch.get_rng_state(), state), "randomk must not touch the global RNG"
    kept = y != 0
    assert int(kept.sum()) == 10 and torch.equal(y[kept], x[kept])


def test_threshold_keeps_entries_above():
    x = randn(200)
    _, y = roundtrip(C.ThresholdCompressor(1.0), x)
    assert torch.equal(y, torch.where(x.abs() > 1.0, x, torch.zeros_like(x)))


def test_dgc_selects_close_to_target():
    x = randn(100_000)
    tensors, y = roundtrip(C.DgcCompressor(0.01), x)
    assert 0.7 * 1000 <= tensors[0].numel() <= 1.3 * 1000
    kept = y != 0
    assert torch.equal(y[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()


def test_dgc_selects_a_nan_it_did_not_sample():
    """A NaN fails every comparison; DGC keeps the entries not below its threshold, so an
    unsampled NaN is still sent (the step's finiteness check then sees it) instead of staying
    in the residual for good."""
    x = randn(100_000)
    x[12_345] = float("nan")
    tensors, y = roundtrip(C.DgcCompressor(0.01), x)
    assert bool(torch.isnan(y[12_345]))
    assert 0.7 * 1000 <= tensors[0].numel() <= 1.3 * 1000


def test_qsgd_levels_and_unbiasedness():
    x = randn(50)
    comp = C.QSGDCompressor(15)
    tensors, _ = roundtrip(comp, x)
    assert tensors[0].dtype == torch.int8 and tensors[0].abs().max() <= 15
    mean = torch.stack([roundtrip(comp, x)[1] for _ in range(2000)]).mean(0)
    assert torch.allclose(mean, x, atol=0.05 * x.norm().item() / 15 * 4)
    assert C.QSGDCompressor(300).compress(x, "w")[0][0].dtype == torch.int16


def test_terngrad_is_ternary_and_unbiased_after_clipping():
    x = randn(40)
    comp = C.TernGradCompressor()
    tensors, y = roundtrip(comp, x)
    scale = tensors[1]
    assert set(tensors[0].unique().tolist()) <= {-1, 0, 1}
    assert set(y.unique().tolist()) <= {-scale.item(), 0.0, scale.item()}
    clip = 2.5 * x.std(correction=0)
    mean = torch.stack([roundtrip(comp, x)[1] for _ in range(4000)]).mean(0)
    assert torch.allclose(mean, x.clamp(-clip, clip), atol=0.1)


def test_sign_compressors():
    x = randn(30)
    _, y = roundtrip(C.SignSGDCompressor(), x)
    assert torch.equal(y, torch.where(x >= 0, 1.0, -1.0))
    vote = majority_vote([torch.tensor([1.0, -1.0, 1.0]), torch.tensor([1.0, -1.0, -1.0]),
                          torch.tensor([-1.0, -1.0, -1.0])])
    assert torch.equal(vote, torch.tensor([1.0, -1.0, -1.0]))
    signum = C.SignumCompressor(0.5)
    signum.compress(torch.ones(3), "w")
    tensors, _ = signum.compress(torch.tensor([-3.0, -0.5, 0.0]), "w")  # momentum: 0.5*g + 0.5*1
    assert tensors[0].tolist() == [0, 1, 1]
    _, y = roundtrip(C.EFSignSGDCompressor(0.1), x)
    assert torch.allclose(y, x.abs().mean() * torch.where(x >= 0, 1.0, -1.0))


def test_onebit_reconstructs_side_means():
    x = randn(64)
    _, y = roundtrip(C.OneBitCompressor(), x)
    neg = x < 0
    assert torch.allclose(y[neg], x[neg].mean().expand(int(neg.sum())))
    assert torch.allclose(y[~neg], x[~neg].mean().expand(int((~neg).sum())))


def test_natural_rounds_to_bracketing_powers_of_two_unbiased():
    x = torch.cat([randn(200) * 10, torch.tensor([0.0, 1.0, -2.0, 3e-30])])
    comp = C.NaturalCompressor()
    tensors, y = roundtrip(comp, x)
    assert tensors[0].dtype == torch.uint8
    nonzero = (y != 0) & (x.abs() > 1e-18)
    log = torch.log2(y[nonzero].abs())
    assert torch.equal(log, log.round()), "decoded magnitudes are powers of two"
    assert torch.all(y[nonzero].abs() <= 2 * x[nonzero].abs())
    assert torch.all(y[nonzero].abs() >= x[nonzero].abs() / 2)
    assert torch.equal(torch.sign(y[nonzero]), torch.sign(x[nonzero]))
    assert y[200].item() == 0.0 and y[201].item() == 1.0 and y[202].item() == -2.0
    mean = torch.stack([roundtrip(comp, x[:200])[1] for _ in range(3000)]).mean(0)
    assert torch.allclose(mean, x[:200], rtol=0.1, atol=0.05)


def test_powersgd_recovers_a_rank_one_matrix():
    def fn(t):
        comp = C.PowerSGDCompressor(rank=1)
        comp.bind(t)
        m = torch.outer(torch.arange(1.0, 7.0), torch.arange(1.0, 5.0)) * (t.rank + 1)
        tensors, ctx = comp.compress(m, "w")
        assert tensors == []
        return comp.decompress(tensors, ctx), m
    results = run_local(3, fn)
    mean = sum(m for _, m in results) / 3
    for y, _ in results:
        assert torch.allclose(y, mean, atol=1e-4)
    bias = torch.arange(3.0)
    comp = C.PowerSGDCompressor()
    assert roundtrip(comp, bias)[1] is bias  # 1-D tensors travel uncompressed


def test_state_dict_round_trips_with_weights_only(tmp_path):
    comp = C.SignumCompressor(0.9)
    comp.compress(randn(5), "layer")
    torch.save(comp.state_dict(), tmp_path / "s.pt")
    other = C.SignumCompressor(0.9)
    other.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert torch.equal(other.momentums["layer"], comp.momentums["layer"])

    x = randn(50)
    uninterrupted, resumed = C.RandomKCompressor(0.1), C.RandomKCompressor(0.1)
    uninterrupted.compress(x, "w")
    torch.save(uninterrupted.state_dict(), tmp_path / "r.pt")
    resumed.load_state_dict(torch.load(tmp_path / "r.pt", weights_only=True))
    assert torch.equal(resumed.compress(x, "w")[1][0], uninterrupted.compress(x, "w")[1][0])


@pytest.mark.parametrize("layout", ["normal", "one_hot_region", "constant", "sparse"])
@pytest.mark.parametrize("n,k", [(1 << 16, 100), (300_000, 3_000), (300_000, 37_500), (70_001, 1)])
def test_topk_abs_prefilter_gives_the_exact_top_k(layout, n, k):
    """The sampled-threshold prefilter returns torch.topk's set, also when the strided sample
    misses every large entry (one_hot_region: the fallback runs) and with ties."""
    from spardl_grace.selection import topk_abs
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(n, generator=g)
    if layout == "one_hot_region":
        x = x * 1e-3
        x[12_345:12_345 + k] = 10 + torch.rand(k, generator=g)  # between sample points
    elif layout == "constant":
        x = torch.ones(n)
    elif layout == "sparse":
        x[torch.rand(n, generator=g) < 0.999] = 0
    got = topk_abs(x, k)
    assert got.numel() == k and got.unique().numel() == k
    want = torch.topk(x.abs(), k, sorted=False).values
    assert torch.equal(x[got].abs().sort().values, want.sort().values)


def test_topk_abs_prefilter_samples_every_phase_of_periodic_zeros(monkeypatch):
    """A 3x3 kernel that only ever sees 1x1 inputs (VGG-16's last convolutions on 28x28
    images) gets gradient on its centre tap only: 8 of every 9 entries are 0. A sample stride
    that is a multiple of 9 (72 here, before the stride became prime) sees only zeros, and
    then every entry became a candidate; now topk runs on about 1.5 k candidates, and the
    result is the exact top-k."""
    from spardl_grace.selection import PREFILTER_SAMPLE, sample_stride, topk_abs
    n = PREFILTER_SAMPLE * 72
    x = torch.zeros(n // 9, 9)
    x[:, 4] = torch.randn(n // 9, generator=torch.Generator().manual_seed(0))
    x = x.reshape(-1)
    k = n // 100
    sizes = []
    real_topk = torch.topk

    def recording_topk(t, *args, **kwargs):
        sizes.append(t.numel())
        return real_topk(t, *args, **kwargs)
    monkeypatch.setattr(torch, "topk", recording_topk)
    got = topk_abs(x, k)
    monkeypatch.undo()
    assert max(sizes) < 3 * k, sizes
    assert torch.equal(x[got].abs().sort().values, torch.topk(x.abs(), k).values.sort().values)
    assert [sample_stride(a) for a in (0, 4, 72, 100)] == [2, 5, 73, 101]


def test_not_below_reads_its_input_each_call_and_keeps_no_reference():
    """not_below is a pure predicate: a buffer written in place between two calls with the
    same threshold gives the new answer, and the tensors it is handed are not kept alive (a
    cache keyed by the tensor, as a misplaced decorator once made it, returned the stale mask
    and held on to up to 256 gradient-sized tensors)."""
    import gc
    import weakref

    from spardl_grace.selection import not_below
    buffer = torch.tensor([0.1, 0.9, float("nan")])
    assert not_below(buffer, 0.5).tolist() == [False, True, True]
    buffer.copy_(torch.tensor([0.9, 0.1, 0.2]))
    assert not_below(buffer, 0.5).tolist() == [True, False, False]
    transient = torch.ones(4)
    alive = weakref.ref(transient)
    not_below(transient, 0.5)
    del transient
    gc.collect()
    assert alive() is None


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.sampled_from([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, float("inf"),
                                        float("-inf"), float("nan")]), min_size=1, max_size=60),
       k=st.integers(0, 70), lift=st.booleans())
def test_topk_abs_lowest_ties_takes_the_lowest_indices_at_the_kth_magnitude(values, k, lift):
    """The k largest |x| with ties broken towards low indices, NaN above everything: what a
    stable descending sort of |x| puts first (torch.sort ranks NaN highest on every device).
    Few distinct values make ties at the k-th magnitude the rule, as with bfloat16 sums;
    `lift` pushes the tensor past the prefilter's size (the same set must come out)."""
    from spardl_grace.selection import topk_abs_lowest_ties
    x = torch.tensor(values, dtype=torch.float64)
    if lift:
        x = torch.cat([x, torch.full((1 << 16,), 0.25, dtype=torch.float64)])
    got = topk_abs_lowest_ties(x, k)
    want = torch.sort(x.abs(), descending=True, stable=True).indices[:k].sort().values
    assert torch.equal(got, want)
