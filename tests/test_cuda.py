"""The CUDA tensor paths, run for real on a GPU: every sparse all-reduce, the DeepReduce codecs,
DistributedOptimizer and the training CLI with their tensors on the GPU.

Skipped where no GPU is visible (CI has none). On a machine with one GPU the ranks share it:
threads over the local transport, or real processes over gloo (which moves CUDA tensors
through the host); NCCL needs a GPU per rank and is not exercised here. What must hold is what
holds on the CPU, checked against the CPU: the same bits on every rank, conservation of gradient
mass, and results identical to the CPU's on the same inputs over the same transport (every sum
is of the same operands in the same order). The gradients are float64: among 10^5 float32
normals some magnitudes tie, and torch.topk breaks ties differently on the two devices.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import scenarios
from conftest import ROOT, _env
from deepreduce_compat import INDEX_CODECS, VALUE_CODECS, codec_from_params
from spardl_grace import DistributedOptimizer, grace_from_params
from spardl_grace.transport import run_local

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda", 0)  # where the tests put tensors (one GPU)
EXACT = {"wire": "exact"}
ALGORITHMS = [("spardl", EXACT), ("spardl", {"teams": 2, **EXACT}),
              ("spardl", {"teams": 4, **EXACT}),
              *((peer, {} if peer == "dense" else EXACT) for peer in scenarios.PEERS),
              # the compact wire (the default): packing and bfloat16 rounding on the GPU give
              # the CPU's bits
              ("spardl", {"wire": "compact"}), ("spardl", {"teams": 2, "wire": "compact"}),
              *((peer, {"wire": "compact"}) for peer in scenarios.PEERS if peer != "dense")]


def steps_on(device: torch.device, transport, params: dict, n: int, steps: int = 4) -> list[dict]:
    """scenarios.sparse_steps with the gradients on `device`; results returned on the CPU."""
    grc = grace_from_params({"memory": "global_residual", "compressor": "topk", **params},
                            transport=transport)
    g = torch.Generator().manual_seed(11 + transport.rank)
    records = []
    for _ in range(steps):
        grad = torch.randn(n, generator=g, dtype=torch.float64).to(device)
        old = grc.memory.residuals.get("w", torch.zeros_like(grad)).clone()
        result = grc.step(grad, "w")
        assert result.device == grad.device and grc.memory.residuals["w"].device == grad.device
        records.append({"compensated": (grad + old).cpu(), "result": result.cpu(),
                        "residual": grc.memory.residuals["w"].cpu()})
    return records


def check_identical_and_conserving(per_rank: list[list[dict]]) -> None:
    size = len(per_rank)
    for step, first in enumerate(per_rank[0]):
        for rank in range(1, size):
            assert torch.equal(per_rank[rank][step]["result"], first["result"]), (rank, step)
        compensated = sum(r[step]["compensated"] for r in per_rank)
        kept = sum(r[step]["residual"] for r in per_rank)
        torch.testing.assert_close(compensated, size * first["result"] + kept, atol=1e-4, rtol=0)


def params_of(comm: str, extra: dict, rho: float) -> dict:
    return {**scenarios.peer_params(comm, rho), **extra}


@pytest.mark.parametrize("comm,extra", ALGORITHMS, ids=lambda a: str(a))
@pytest.mark.parametrize("rho", [0.01, 0.2, 1.0])
def test_sparse_allreduces_on_cuda_equal_the_cpu_bit_for_bit(comm, extra, rho):
    n = 100_003
    on_gpu = run_local(4, lambda t: steps_on(CUDA, t, params_of(comm, extra, rho), n))
    on_cpu = run_local(4, lambda t: steps_on(torch.device("cpu"), t, params_of(comm, extra, rho), n))
    check_identical_and_conserving(on_gpu)
    for rank in range(4):
        for gpu, cpu in zip(on_gpu[rank], on_cpu[rank]):
            assert torch.equal(gpu["result"], cpu["result"])
            assert torch.equal(gpu["residual"], cpu["residual"])


def gloo_cuda_steps(transport) -> dict:
    """Entry point for tests/mp_worker.py: every algorithm on gradients on this rank's GPU, then
    on the CPU (gloo's own all-reduce sums in its own order: compare over the same transport)."""
    return {f"{where}.{comm}{json.dumps(extra)}":
            steps_on(torch.device(where), transport, params_of(comm, extra, 0.05), 20_011)
            for where in ("cuda", "cpu") for comm, extra in ALGORITHMS}


def test_gloo_processes_sharing_one_gpu_equal_the_cpu(launch):
    per_rank = launch("gloo", 4, "test_cuda.gloo_cuda_steps")
    for comm, extra in ALGORITHMS:
        key = f"{comm}{json.dumps(extra)}"
        got = [r[f"cuda.{key}"] for r in per_rank]
        check_identical_and_conserving(got)
        for rank in range(4):
            for gpu, cpu in zip(got[rank], per_rank[rank][f"cpu.{key}"]):
                assert torch.equal(gpu["result"], cpu["result"]), (key, rank)
                assert torch.equal(gpu["residual"], cpu["residual"]), (key, rank)


@pytest.mark.parametrize("index", sorted(INDEX_CODECS))
@pytest.mark.parametrize("value", sorted(VALUE_CODECS))
def test_codecs_on_cuda_decode_what_they_report_and_index_bytes_equal_the_cpu(index, value):
    block = torch.randn(50_000, generator=torch.Generator().manual_seed(5))
    positions = torch.sort(torch.topk(block.abs(), 500).indices).values
    codec = codec_from_params({"deepreduce": "both", "index": index, "value": value,
                               "policy": "conflict_sets", "fpr": 0.05})
    enc = codec.encode(block.to(CUDA), positions.to(CUDA), "step.1")
    got_positions, got_values = codec.decode(enc.data, block.numel(), block.dtype, CUDA, "step.1")
    assert got_positions.device == got_values.device == CUDA
    assert torch.equal(got_positions, enc.indices) and torch.equal(got_values, enc.values)
    if value in ("none", "deflate"):  # lossless values: the positions' own values come back
        assert torch.equal(got_values.cpu(), block[got_positions.cpu()])
    on_cpu = codec_from_params({"deepreduce": "index", "index": index, "policy": "conflict_sets",
                                "fpr": 0.05})
    assert torch.equal(on_cpu.encode(block, positions, "step.1").data.cpu(),
                       on_cpu.encode(block.to(CUDA), positions.to(CUDA), "step.1").data.cpu())


def train_linear(transport, device: torch.device, comm: str) -> list[torch.Tensor]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    init = torch.Generator().manual_seed(3)  # the ranks are threads: no shared global generator
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.2)
    model.to(device)
    grc = grace_from_params({**params_of(comm, {}, 0.1), "memory": "global_residual",
                             "compressor": "topk"}, transport=transport)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grc,
                               named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(transport.rank)
    for _ in range(5):
        x, y = torch.randn(16, 64, generator=g).to(device), torch.randint(10, (16,), generator=g).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("comm", ["spardl", "topka", "dense"])
def test_distributed_optimizer_on_cuda_keeps_every_rank_identical(comm):
    on_gpu = run_local(3, lambda t: train_linear(t, CUDA, comm))
    for rank in range(1, 3):
        assert all(torch.equal(a, b) for a, b in zip(on_gpu[rank], on_gpu[0]))
    if comm == "dense":
        # cuBLAS and the CPU's BLAS sum matrix products in different orders: close, not equal
        # (with selection, such last-bit differences may pick other entries, so only dense).
        on_cpu = run_local(3, lambda t: train_linear(t, torch.device("cpu"), comm))
        for a, b in zip(on_gpu[0], on_cpu[0]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("compressor", ["spardl", "torch_powersgd"])
def test_training_cli_on_cuda(tmp_path, compressor):
    """Two workers share the GPU over gloo; both end with the same parameters on the GPU."""
    cmd = [sys.executable, "-m", "experiments.main_trainer", "--dnn", "fashioncnn", "--nworkers", "2",
           "--device", "cuda", "--compression", "--compressor", compressor, "--train-samples", "2048",
           "--test-samples", "500", "--max-steps", "12", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    final = [torch.load(tmp_path / f"final-rank{r}.pt", weights_only=True) for r in range(2)]
    assert torch.equal(final[0]["params"], final[1]["params"])
    assert torch.isfinite(final[0]["params"]).all()
    assert 0.1 < final[0]["summary"]["test_accuracy"] <= 1.0


SPARSE = [("spardl", {}), *((peer, {}) for peer in scenarios.PEERS if peer != "dense")]


@pytest.mark.parametrize("comm,extra", SPARSE, ids=lambda a: str(a))
def test_periodic_zeros_on_cuda_equal_the_cpu(comm, extra):
    """A gradient with 8 of every 9 entries zero (VGG-16's last 3x3 convolutions see 1x1
    inputs), large enough for the top-k prefilter, at a density whose 1.5 k exceeds the
    non-zeros: its sample finds a threshold of 0 and keeps only non-zero candidates, on the GPU
    as on the CPU, bit for bit."""
    n = 9 * (1 << 14)

    def fn(device):
        def per_rank(t):
            grc = grace_from_params({"memory": "global_residual", "compressor": "topk",
                                     **params_of(comm, extra, 0.1)}, transport=t)
            g = torch.Generator().manual_seed(t.rank)
            out = []
            for _ in range(3):
                grad = torch.zeros(n, dtype=torch.float64)
                grad[4::9] = torch.randn(n // 9, generator=g, dtype=torch.float64)
                out.append(grc.step(grad.to(device), "w").cpu())
            return out
        return run_local(4, per_rank)
    on_gpu, on_cpu = fn(CUDA), fn(torch.device("cpu"))
    for rank in range(4):
        for step, (gpu, cpu) in enumerate(zip(on_gpu[rank], on_cpu[rank])):
            assert torch.equal(gpu, cpu) and torch.equal(gpu, on_gpu[0][step]), (rank, step)


@pytest.mark.parametrize("comm,extra", SPARSE, ids=lambda a: str(a))
def test_a_nan_on_cuda_reaches_every_ranks_result_and_lent_results_equal_fresh(comm, extra):
    """On the GPU as on the CPU: a NaN on one rank is selected (through the prefilter and
    Ok-Topk's reused thresholds) and reaches every rank's result, result_is_finite says so
    from the support alone, and results lent under reuse_results equal fresh ones."""
    n = 1 << 17

    def fn(t, reuse):
        grc = grace_from_params({"memory": "global_residual", "compressor": "topk",
                                 **params_of(comm, extra, 0.01)}, transport=t)
        grc.reuse_results = reuse
        g = torch.Generator().manual_seed(t.rank)
        out = []
        for step in range(5):
            grad = torch.randn(n, generator=g).to(CUDA)
            if step == 2 and t.rank == 1:
                grad[12345] = float("nan")
            result = grc.step(grad, "w")
            out.append((result.nan_to_num(0.0, 1.0, -1.0).cpu(),
                        bool(torch.isfinite(result).all()), grc.result_is_finite(result, "w")))
            grc.memory.residuals["w"].nan_to_num_(0.0, 0.0, 0.0)  # go on after the bad step
        return out
    lent, fresh = run_local(3, fn, True), run_local(3, fn, False)
    for rank in range(3):
        assert [(full, sparse) for _, full, sparse in lent[rank]] == [
            (True, True), (True, True), (False, False), (True, True), (True, True)]
        for (a, _, _), (b, _, _), (c, _, _) in zip(lent[rank], fresh[rank], lent[0]):
            assert torch.equal(a, b) and torch.equal(a, c)


SLOW_PRODUCTS = 8  # 4096 x 4096 float32 products before each gradient is written: ~20 ms
SLOW_SIZES = (40_000, 70_001, 25_000, 90_000)  # one bucket each (bucket_cap_mb below)


class SlowGradient(torch.autograd.Function):
    """Backward runs slow matrix products on the current stream and then writes `given` as
    the weight's gradient: a stream that read the gradient without waiting for backward's
    stream would read it before it is written."""

    @staticmethod
    def forward(ctx, weight, given, work):
        ctx.save_for_backward(given, work)
        return (weight * 0).sum()

    @staticmethod
    def backward(ctx, _):
        given, work = ctx.saved_tensors
        if work.is_cuda:
            for _ in range(SLOW_PRODUCTS):
                torch.mm(work, work)
        return given.clone(), None, None


class SlowModel(torch.nn.Module):
    """Parameters whose gradient at (rank, step) is a fixed float64 draw, written late."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(n, dtype=torch.float64, device=device)) for n in SLOW_SIZES)
        self.register_buffer("work", torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))
                             .to(device), persistent=False)

    def forward(self, rank: int, step: int):
        g = torch.Generator().manual_seed(1000 * rank + step)
        return sum(SlowGradient.apply(w, torch.randn(w.numel(), generator=g, dtype=torch.float64)
                                      .to(w.device), self.work) for w in self.weights)


def synchronised_gradients(transport, device: torch.device, integration: str, overlap: bool,
                           steps: int = 4) -> list[list[torch.Tensor]]:
    """Each step's averaged gradients (SparDL at 0.05 on the default wire) through
    DistributedOptimizer or the DDP hook, one bucket per weight, with or without the
    communication thread."""
    from spardl_grace import CommHookState, comm_hook
    model = SlowModel(device)
    grc = grace_from_params({"compressor": "topk", "memory": "global_residual",
                             "communicator": "spardl", "compress_ratio": 0.05}, transport=transport)
    if integration == "ddp_hook":
        trained = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=0.3,
            broadcast_buffers=False)
        trained.register_comm_hook(CommHookState(grc, trained, overlap=overlap), comm_hook)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.0)
    else:
        trained = model
        optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), grc,
                                         named_parameters=model.named_parameters(),
                                         bucket_cap_mb=0.3, overlap=overlap)
    out = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        trained(transport.rank, step).backward()
        optimizer.step()
        out.append([w.grad.detach().cpu().clone() for w in model.weights])
    return out


def unsynchronised_read_differs() -> bool:
    """The hazard the events guard against, shown here: a side stream that copies a gradient
    without waiting reads it before backward's stream has written it."""
    model = SlowModel(CUDA)
    side = torch.cuda.Stream(CUDA)
    missed = False
    for step in range(3):
        model.weights[0].grad = None
        model(0, step).backward()  # returns once the kernels are launched, not run
        grad = model.weights[0].grad
        with torch.cuda.stream(side):
            early = grad.clone()
        torch.cuda.synchronize(CUDA)
        missed = missed or not torch.equal(early, grad)
    return missed


def overlapped_gradients(transport) -> dict:
    """Entry point for tests/mp_worker.py: two gloo processes sharing the GPU."""
    torch.cuda.set_device(CUDA)
    out = {"hazard_seen": unsynchronised_read_differs()}
    for integration in ("optimizer", "ddp_hook"):
        for overlap in (True, False):
            out[f"cuda.{integration}.{overlap}"] = synchronised_gradients(
                transport, CUDA, integration, overlap)
        out[f"cpu.{integration}"] = synchronised_gradients(
            transport, torch.device("cpu"), integration, True)
    return out


def test_communication_thread_overlaps_backward_on_its_own_stream_and_equals_the_cpu(launch):
    """Two processes share the GPU over gloo. Each bucket's gradient is written after ~20 ms of
    matrix products on backward's stream while the communication thread already works on
    earlier buckets on its own stream: the events make it wait for each gradient, so
    DistributedOptimizer and the DDP hook give, bit for bit, what they give without the
    thread and what the CPU gives, on both ranks. The control shows that a stream that does
    not wait reads the gradients unwritten here, so the comparison can fail."""
    per_rank = launch("gloo", 2, "test_cuda.overlapped_gradients", timeout=400)
    assert per_rank[0]["hazard_seen"] and per_rank[1]["hazard_seen"]
    for integration in ("optimizer", "ddp_hook"):
        cpu = per_rank[0][f"cpu.{integration}"]
        for rank in range(2):
            for key in (f"cuda.{integration}.True", f"cuda.{integration}.False", f"cpu.{integration}"):
                for step, (got, want) in enumerate(zip(per_rank[rank][key], cpu)):
                    assert all(torch.equal(a, b) for a, b in zip(got, want)), (key, rank, step)
