"""One rank of benchmarks.comm: `python -m benchmarks.comm_worker CONFIG.json`.

Joins the launcher's ranks (env:// for gloo, mpirun, horovodrun), measures the link (alpha and
beta between ranks 0 and 1) and times probes shaped like each op kind of the cost model at
this P, makes the gradients, then times every algorithm in turn on the same gradients and
writes OUT/rank{r}.json. Started by benchmarks.comm, not by hand.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.costmodel import KINDS, probe_chain, probe_op
from testbed.netem import burst_bytes, rate_bits_per_s
from deepreduce_compat import deepreduce_from_params
from spardl_grace.transport import CountingTransport
from spardl_grace.launch import join
from spardl_grace.transport import Transport
from spardl_grace.transport.counting import Message

STAT_TIMES = ("selection_s", "comm_s", "coding_s")
# What PyTorch users run instead: DDP with torch's own hooks (testbed.baselines), by name.
TORCH_HOOKS = {"torch_ddp": ("torch_ddp", 1), "torch_fp16": ("torch_fp16", 1),
               "torch_powersgd1": ("torch_powersgd", 1), "torch_powersgd4": ("torch_powersgd", 4)}
POWERSGD_START = 2  # the earliest step torch's PowerSGD hook compresses with error feedback
# What Horovod users run: hvd.allreduce of the gradient, plain or with Horovod's fp16 compression.
HOROVOD = {"horovod_allreduce": "none", "horovod_fp16": "fp16"}


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (nothing to wait for on a CPU), so that a host
    clock read after it times that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def algorithm_params(name: str, density: float, teams: int, codec: dict[str, Any]) -> dict[str, Any]:
    """GRACE params of one benchmarked algorithm: the training CLI's, codec on sparse ones, else
    the exact wire or, on a '_compact' name, the compact one (benchmarks.costmodel.variant; the
    library's default is compact, so both are named), and no floor on the
    entries sent, so that a sparse one sends `density` as the cost formulas say."""
    from benchmarks.costmodel import variant
    from testbed.configs import allreduce_params
    algorithm, wire = variant(name)
    params = allreduce_params(algorithm, teams)
    if algorithm == "dense":
        return params
    return {**params, "compress_ratio": density, "min_entries": 0, **codec,
            **({} if codec else {"wire": wire})}


def gradients(cfg: dict[str, Any], rank: int, steps: int) -> list[torch.Tensor]:
    """`steps` flat gradients of this rank: seeded normal noise, or a real model's gradient on
    this rank's own Fashion-MNIST batches."""
    device = torch.device(cfg["device"])
    if cfg["gradient"] == "random":
        g = torch.Generator().manual_seed(1000 * rank + 1)
        return [torch.randn(cfg["numel"], generator=g).to(device) for _ in range(steps)]
    from testbed.datasets import load_fashion_mnist
    from testbed.models import build_model
    from spardl_grace.fusion import flatten_grads
    images, labels = load_fashion_mnist("train")
    torch.manual_seed(0)
    model = build_model(cfg["gradient"], 1, 10).to(device)
    batch = cfg["batch_size"]
    out = []
    for step in range(steps):
        lo = ((step * cfg["workers"]) + rank) * batch % (len(images) - batch)
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(images[lo:lo + batch].to(device)),
                                                 labels[lo:lo + batch].to(device))
        loss.backward()
        out.append(flatten_grads(model.parameters()).clone())
    return out


def measure_link(transport: Transport, repeat: int = 30, nbytes: int = 16 << 20) -> dict[str, float]:
    """alpha: half the median round trip of a 4-byte exchange between ranks 0 and 1; beta: the
    median seconds per byte of a `nbytes` exchange, alpha removed. The other ranks exchange with
    themselves (Horovod's exchanges are collectives that every rank must enter)."""
    result = {"alpha": 0.0, "beta": 0.0}
    rank = transport.rank
    if transport.size < 2:
        return result
    peer = 1 - rank if rank < 2 else rank
    small, big = torch.zeros(1), torch.zeros(nbytes // 4)
    # The large exchange is long enough for TCP to reach the shaped rate: 16 MB each way read
    # 95 Mbit/s on a 100 Mbit link and 968 on a 1 Gbit one (before the transport posted its
    # receive first, gloo serialised the two directions and this read half the rate).
    for what, tensor, times in (("alpha", small, repeat), ("beta", big, 3)):
        samples = []
        for i in range(times):
            transport.barrier(f"link.{what}.{i}")
            start = time.perf_counter()
            transport.sendrecv(tensor, peer, peer, f"link.{what}.{i}.a")
            transport.sendrecv(tensor, peer, peer, f"link.{what}.{i}.b")
            samples.append((time.perf_counter() - start) / 2)
        if rank < 2:
            one_way = statistics.median(samples)
            result[what] = one_way if what == "alpha" else max(one_way - result["alpha"], 0.0) / nbytes
    shared = transport.broadcast(torch.tensor([result["alpha"], result["beta"]], dtype=torch.float64),
                                 0, "link.result")
    return {"alpha": float(shared[0]), "beta": float(shared[1])}


PROBE_BYTES = (256, 1 << 16, 1 << 20, 16 << 20)  # from a histogram to a dense VGG-16 layer


def run_probe(transport: Transport, kind: str, nbytes: int, name: str) -> int:
    """Run the transport op that costmodel.probe_op(kind, nbytes, P) describes, back to back
    as the algorithms run their ops, as many as costmodel.probe_chain says (the chain the fit
    models); return how many ran. p2p: P - 1 exchanges with the ranks at distance 1, 2, ..,
    P - 1 in turn, as SRS, Bruck all-gathers and butterflies move through their peers. With more ranks than cores an
    op in such a chain costs several times one run alone after a barrier (at P = 8 on the
    benchmark machine: an exchange 3.8 against 0.7 ms, a 128-byte all-reduce 10 to 35 against
    2 ms), because every op waits for the last rank that the scheduler let finish the one
    before."""
    op = probe_op(kind, nbytes, transport.size, transport.rank)
    rank, size = transport.rank, transport.size
    chain = probe_chain(kind, size)
    if kind == "p2p":
        entries = op.sent // 4
        for d in range(1, chain + 1):
            transport.sendrecv(torch.zeros(entries), (rank + d) % size, (rank - d) % size,
                               f"{name}.{d}", recv_numel=entries)
        return chain
    for i in range(chain):
        if kind == "allgather":
            transport.allgather(torch.zeros(op.sent // (4 * (size - 1))), f"{name}.{i}")
        elif kind == "alltoall":
            transport.alltoall([torch.zeros(op.sent // (4 * (size - 1)))] * size, f"{name}.{i}")
        elif kind == "allreduce":
            transport.allreduce(torch.zeros(op.size // 4), f"{name}.{i}")
        else:
            transport.broadcast(torch.zeros(op.size // 4), 0, f"{name}.{i}")
    return chain


def probe_ops(transport: Transport, sizes: tuple[int, ...] = PROBE_BYTES,
              repeat: int = 3, idle_s: float = 0.0
              ) -> tuple[dict[str, list[list[float]]], dict[str, list[list[float]]]]:
    """Seconds of one op of every kind (costmodel.KINDS) at this P for each size in `sizes` (in
    the cost model's measure of that kind; see run_probe), as (fastest, slowest): per kind
    [nbytes, seconds] pairs, the median over `repeat` runs of the fastest rank's time (the
    convention of comm_s) and of the slowest rank's (the one a step waits for: the rank that
    leaves the barrier last finishes the chain soonest, so the fastest rank's time leaves out
    the skew that every chained op passes on). Each run after a barrier and `idle_s` seconds
    of idling (replay_idle_s: the fit assumes a full bucket at a probe's start). Every rank
    returns the same figures."""
    samples = []
    for kind in KINDS:
        for nbytes in sizes:
            for i in range(repeat):
                name = f"probe.{kind}.{nbytes}.{i}"
                transport.barrier(name)
                time.sleep(idle_s)
                start = time.perf_counter()
                ops = run_probe(transport, kind, nbytes, name)
                samples.append((time.perf_counter() - start) / ops)
    every = torch.stack(transport.allgather(torch.tensor(samples, dtype=torch.float64), "probe.times"))
    shape = (len(KINDS), len(sizes), repeat)

    def medians(per_run: torch.Tensor) -> dict[str, list[list[float]]]:
        times = per_run.view(shape)
        return {kind: [[nbytes, float(times[k, j].median())] for j, nbytes in enumerate(sizes)]
                for k, kind in enumerate(KINDS)}

    return medians(every.min(dim=0).values), medians(every.max(dim=0).values)


def replay(transport: Transport, messages: list[Message]) -> None:
    """Send and receive exactly the messages of a recorded step (this rank's CountingTransport
    trace), with no computation between them: the step's communication alone. Every rank
    replays its own trace, so the ops match up as they did in the step."""
    size, i = transport.size, 0
    while i < len(messages):
        m = messages[i]
        name = f"replay.{i}"
        if m.op in ("send", "recv"):
            send, recv = (m, messages[i + 1]) if m.op == "send" else (messages[i + 1], m)
            transport.sendrecv(torch.zeros(send.bytes_sent, dtype=torch.uint8), send.peer,
                               recv.peer, name, recv_numel=recv.bytes_received)
            i += 2
            continue
        if m.op == "alltoall":
            peers = {}
            while i < len(messages) and messages[i].op == "alltoall" and messages[i].name == m.name:
                peers[messages[i].peer] = messages[i].bytes_sent
                i += 1
            transport.alltoall([torch.zeros(peers.get(p, 0), dtype=torch.uint8)
                                for p in range(size)], name)
            continue
        if m.op == "allgather":
            transport.allgather(torch.zeros(m.bytes_sent // (size - 1), dtype=torch.uint8), name)
        elif m.op == "allreduce":
            nbytes = m.bytes_sent * size // (2 * (size - 1))
            # float32, which every backend reduces (Horovod has no uint8 all-reduce)
            transport.allreduce(torch.zeros(-(-nbytes // 4), dtype=torch.float32), name)
        elif m.op == "broadcast":
            root = transport.rank if m.peer < 0 else m.peer
            nbytes = m.bytes_received or m.bytes_sent // (size - 1)
            transport.broadcast(torch.zeros(nbytes, dtype=torch.uint8), root, name)
        i += 1


def replay_idle_s(bandwidth: str | None) -> float:
    """Idle seconds before each replay and probe on an emulated link: twice the time its rate
    takes to refill its shaper's bucket (testbed.netem.burst_bytes), so that each starts as
    a training step does after its computation, and as the cost model assumes, with a full
    bucket; back to back, each would find the bucket its predecessor drained. 0 on an unshaped
    network."""
    if not bandwidth:
        return 0.0
    bits = rate_bits_per_s(bandwidth)
    return 2 * burst_bytes(bits) * 8 / bits


def time_replay(transport: Transport, messages: list[Message], repeat: int,
                idle_s: float = 0.0) -> list[float]:
    """This rank's seconds for each of `repeat` replays of a step's trace, each after a barrier
    and `idle_s` seconds of idling (replay_idle_s)."""
    times = []
    for i in range(repeat):
        transport.barrier(f"replay.{i}")
        time.sleep(idle_s)
        start = time.perf_counter()
        replay(transport, messages)
        times.append(time.perf_counter() - start)
    return times


def time_copy(transport: Transport, grad: torch.Tensor, target: torch.Tensor, name: str) -> float:
    """Seconds of one copy of the gradient into an allocated buffer, every rank copying at once
    after a barrier as in a step (so with the same share of the cores): the unit in which the
    benchmark states an algorithm's passes over the gradient."""
    transport.barrier(name)
    start = time.perf_counter()
    target.copy_(grad)
    synchronize(grad.device)
    return time.perf_counter() - start


def time_algorithm(name: str, cfg: dict[str, Any], grads: list[torch.Tensor],
                   transport: Transport) -> dict[str, Any]:
    """Warm-up steps, then `repeat` timed steps; per step this rank's seconds and bytes, the
    seconds of one copy of the gradient taken just before it (`copy_s`), and the last step's
    message trace and statistics; then that trace replayed `replays` times (`replay_s`,
    communication without the computation between messages)."""
    counting = CountingTransport(transport)
    grc = deepreduce_from_params(algorithm_params(name, cfg["density"], cfg["teams"],
                                                  cfg["codec"]), transport=counting)
    target = torch.empty_like(grads[0])
    steps = []
    for i, grad in enumerate(grads):
        copy_s = time_copy(transport, grad, target, f"{name}.copy.{i}")
        counting.reset()
        own = grad.clone()  # steps must not see each other's writes; copying is not timed
        transport.barrier(f"{name}.{i}")
        start = time.perf_counter()
        grc.step(own, "grad")
        synchronize(grad.device)
        total = time.perf_counter() - start
        if i < cfg["warmup"]:
            continue
        stats = dict(grc.last_stats)
        steps.append({"total_s": total, **{k: float(stats.get(k, 0.0)) for k in STAT_TIMES},
                      "copy_s": copy_s, "bytes_sent": counting.bytes_sent, "stats": stats})
    trace = list(counting.messages)
    messages = [[m.op, m.name, m.peer, m.bytes_sent, m.bytes_received] for m in trace]
    return {"steps": steps, "messages": messages,
            "replay_s": time_replay(transport, trace, cfg["replays"],
                                    replay_idle_s(cfg["bandwidth"]))}


class _Shapes(torch.nn.Module):
    """Parameters of a model's layer shapes; the loss sum_p <p, g_p> makes backward produce the
    given gradient g_p for each."""

    def __init__(self, shapes: list[torch.Size], device: torch.device):
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s, device=device))
                                              for s in shapes)

    def forward(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.weights, grads))


def time_torch_hook(name: str, cfg: dict[str, Any], grads: list[torch.Tensor],
                    transport: Transport) -> dict[str, Any]:
    """PyTorch's DDP with its own hook, on the real layer shapes of cfg['gradient']: each step's
    backward produces this rank's gradient and DDP synchronises it through the hook during
    backward (PowerSGD compresses from step POWERSGD_START on). The same backward
    without DDP is timed beside it in every step, and the total is the difference: DDP's
    bucket copies and the hook's work and communication, not the autograd pass that made the
    gradient (which grc.step is spared too)."""
    from testbed.baselines import TorchDDPSync
    from testbed.models import build_model
    device = grads[0].device
    shapes = [p.shape for p in build_model(cfg["gradient"], 1, 10).parameters()]
    baseline, rank = TORCH_HOOKS[name]
    local = _Shapes(shapes, device)
    ddp = TorchDDPSync(_Shapes(shapes, device), torch.optim.SGD([torch.zeros(1)], lr=0.0),
                       baseline, powersgd_rank=rank, start_iter=POWERSGD_START)
    steps = []
    for i, grad in enumerate(grads):
        parts = [g.view(s) for g, s in zip(torch.split(grad, [s.numel() for s in shapes]), shapes)]
        times = {}
        for what, module in (("local", local), ("ddp", ddp.model)):
            module.zero_grad()
            transport.barrier(f"{name}.{what}.{i}")
            start = time.perf_counter()
            module(parts).backward()
            synchronize(device)
            times[what] = time.perf_counter() - start
        sent = ddp.bytes_sent
        ddp.step()
        if i < cfg["warmup"]:
            continue
        total = max(times["ddp"] - times["local"], 0.0)
        steps.append({"total_s": total, "selection_s": 0.0, "comm_s": total, "coding_s": 0.0,
                      "bytes_sent": ddp.bytes_sent - sent,
                      "stats": {"backward_s": times["local"], "ddp_backward_s": times["ddp"]}})
    return {"steps": steps, "messages": []}


def time_horovod(name: str, cfg: dict[str, Any], grads: list[torch.Tensor],
                 transport: Transport) -> dict[str, Any]:
    """Horovod's own averaging all-reduce of the whole gradient (under horovodrun), with
    Horovod's fp16 compression for horovod_fp16: what a Horovod user's DistributedOptimizer
    does without this library. Bytes are those of a ring all-reduce of what Horovod sends."""
    import horovod.torch as hvd
    from spardl_grace.transport.counting import ring_allreduce_bytes
    compression = hvd.Compression.fp16 if HOROVOD[name] == "fp16" else hvd.Compression.none
    itemsize = 2 if HOROVOD[name] == "fp16" else 4
    steps = []
    for i, grad in enumerate(grads):
        own = grad.clone()
        transport.barrier(f"{name}.{i}")
        start = time.perf_counter()
        hvd.allreduce(own, op=hvd.Average, compression=compression, name=f"{name}.grad")
        synchronize(grad.device)
        total = time.perf_counter() - start
        if i < cfg["warmup"]:
            continue
        steps.append({"total_s": total, "selection_s": 0.0, "comm_s": total, "coding_s": 0.0,
                      "bytes_sent": ring_allreduce_bytes(itemsize * grad.numel(), transport.size),
                      "stats": {}})
    return {"steps": steps, "messages": []}


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    transport = join(cfg["timeout"])
    rank = transport.rank
    if transport.size != cfg["workers"]:
        raise SystemExit(f"launched {transport.size} ranks, the config says {cfg['workers']}")
    link = measure_link(transport)
    probes, probes_slowest = probe_ops(transport, repeat=cfg["probe_repeat"],
                                       idle_s=replay_idle_s(cfg["bandwidth"]))
    grads = gradients(cfg, rank, cfg["warmup"] + cfg["repeat"])
    out = {"rank": rank, "numel": grads[0].numel(), "link": link, "probes": probes,
           "probes_slowest": probes_slowest, "algorithms": {}}
    for name in cfg["algorithms"]:
        timer = time_torch_hook if name in TORCH_HOOKS else \
            time_horovod if name in HOROVOD else time_algorithm
        out["algorithms"][name] = timer(name, cfg, grads, transport)
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(out))
    transport.barrier("done")
    if "RANK" in os.environ and "HOROVOD_RANK" not in os.environ:
        from spardl_grace.transport.torch_dist import destroy_and_exit
        destroy_and_exit()


if __name__ == "__main__":
    main(sys.argv[1])
