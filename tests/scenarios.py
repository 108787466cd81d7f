"""SPMD scenarios shared by the in-process tests (run_local) and the real multi-process runs
(tests/mp_worker.py). Each takes a Transport and returns plain data for the test to check.
Inputs depend only on (rank, size), so the test can recompute what every rank sent."""
from __future__ import annotations

import os

from contextlib import contextmanager

import torch

from deepreduce_compat import deepreduce_from_params
from spardl_grace import grace_from_params
from sparse_checks import mechanics

# int16: QSGD's levels above 127; gloo's and NCCL's collectives refuse it ("Invalid scalar type")
DTYPES = [torch.float32, torch.int32, torch.uint8, torch.bfloat16, torch.float64, torch.int16]


def rank_tensor(rank: int, n: int, dtype: torch.dtype = torch.float32, salt: int = 0) -> torch.Tensor:
    """A deterministic 1-D tensor of n entries for `rank` (small integers: exact in every dtype)."""
    values = (torch.arange(n, dtype=torch.int64) * 7 + rank * 13 + salt * 5) % 97 - 40
    if dtype == torch.uint8:
        values = values.abs()
    return values.to(dtype)


def variable_size(rank: int, peer: int) -> int:
    """Message sizes that vary by sender and receiver and are 0 for some pairs."""
    return (3 * rank + 5 * peer) % 7


def transport_ops(transport) -> dict:
    """Every Transport operation with variable and empty sizes and several dtypes."""
    r, p = transport.rank, transport.size
    out = {}
    for dtype in DTYPES:
        tag = str(dtype).split(".")[-1]
        dst, src = (r + 1) % p, (r - 1) % p
        out[f"sendrecv.{tag}"] = transport.sendrecv(
            rank_tensor(r, variable_size(r, dst), dtype), dst, src, f"sr.{tag}")
        out[f"allgather.{tag}"] = transport.allgather(
            rank_tensor(r, variable_size(r, 0), dtype), f"ag.{tag}")
        out[f"alltoall.{tag}"] = transport.alltoall(
            [rank_tensor(r, variable_size(r, j), dtype, salt=j) for j in range(p)], f"a2a.{tag}")
        out[f"broadcast.{tag}"] = transport.broadcast(
            rank_tensor(r if r == p - 1 else 99, 6, dtype).view(2, 3), p - 1, f"bc.{tag}")
    out["allreduce.float32"] = transport.allreduce(rank_tensor(r, 10).view(2, 5), "ar.f32")
    out["allreduce.float64"] = transport.allreduce(rank_tensor(r, 10, torch.float64), "ar.f64")
    out["allreduce.int32"] = transport.allreduce(rank_tensor(r, 10, torch.int32), "ar.i32")
    out["allreduce.uint8"] = transport.allreduce(rank_tensor(r, 10, torch.uint8), "ar.u8")
    out["allreduce.int16"] = transport.allreduce(rank_tensor(r, 10, torch.int16), "ar.i16")
    out["allreduce.random"] = transport.allreduce(
        torch.randn(1000, generator=torch.Generator().manual_seed(r)), "ar.rand")
    transport.barrier()
    return out


def horovod_p2p_modes(transport) -> dict:
    """transport_ops and known_size_sendrecv under horovodrun, through the gloo channel (the
    default) and through Horovod's alltoall (p2p='horovod'); each with how it sent."""
    from spardl_grace.transport.horovod import HorovodTransport
    through_horovod = HorovodTransport(transport.timeout, prefix="via_hvd", p2p="horovod")
    return {mode: {"p2p": t.p2p, "ops": transport_ops(t), "known": known_size_sendrecv(t)}
            for mode, t in (("gloo", transport), ("horovod", through_horovod))}


def horovod_channel_fallback(transport) -> dict:
    """A gloo channel that rank 1 cannot join (its interface does not exist): every rank
    warns, sends through Horovod's alltoall instead, and the operations still agree."""
    import warnings

    from spardl_grace.transport import horovod
    old = os.environ.get("HOROVOD_GLOO_IFACE")
    if transport.rank == 1:
        os.environ["HOROVOD_GLOO_IFACE"] = "nosuchnic0"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fallback = horovod.HorovodTransport(5.0, prefix="fallback")
    finally:
        horovod._UNREACHABLE.clear()  # the next transport's channel can be opened again
        if old is None:
            os.environ.pop("HOROVOD_GLOO_IFACE", None)
        else:
            os.environ["HOROVOD_GLOO_IFACE"] = old
    return {"p2p": fallback.p2p, "warnings": [str(w.message) for w in caught],
            "ops": transport_ops(fallback)}


def horovod_channels_beside_user_ops(transport) -> dict:
    """Five more transports, as a script makes them (broadcast_parameters' shared one, two
    optimizers, one made again after a restart...), then the user's own unnamed Horovod
    all-reduces, 200 of them, and one all-reduce on every channel. Returns how many gloo
    devices the channels use and every sum."""
    import horovod.torch as hvd

    from spardl_grace.transport.horovod import HorovodTransport
    transports = [transport] + [HorovodTransport(transport.timeout) for _ in range(5)]
    user = [float(hvd.allreduce(torch.tensor([float(i + transport.rank)]), op=hvd.Sum))
            for i in range(200)]
    channel_sums = [float(t.allreduce(torch.tensor([float(k + 1)]), f"channel{k}"))
                    for k, t in enumerate(transports)]
    return {"p2p": [t.p2p for t in transports],
            "devices": len({id(t._channel.device) for t in transports}),
            "user": user, "channel_sums": channel_sums}


def known_size_sendrecv(transport) -> dict:
    """sendrecv with the size announced (one round trip), for every dtype and sizes including 0;
    then every rank sends one entry fewer than announced, which every receiver must refuse."""
    from spardl_grace.transport import TransportError
    r, p = transport.rank, transport.size
    dst, src = (r + 1) % p, (r - 1) % p
    out = {}
    for dtype in DTYPES:
        tag = str(dtype).split(".")[-1]
        out[tag] = transport.sendrecv(rank_tensor(r, variable_size(r, dst), dtype), dst, src,
                                      f"known.{tag}", recv_numel=variable_size(src, r))
    try:
        transport.sendrecv(rank_tensor(r, 4), dst, src, "short", recv_numel=5)
        out["short_refused"] = ""
    except TransportError as exc:
        out["short_refused"] = str(exc)
    return out


@contextmanager
def recorded_p2p_batches(batches: list[list[str]]):
    """Within the block, every torch.distributed.batch_isend_irecv call appends its ops'
    kinds ("recv"/"send", in posting order) to `batches`."""
    import torch.distributed as dist
    original = dist.batch_isend_irecv

    def recording(ops):
        batches.append(["recv" if op.op is dist.irecv else "send" for op in ops])
        return original(ops)

    dist.batch_isend_irecv = recording
    try:
        yield
    finally:
        dist.batch_isend_irecv = original


@contextmanager
def recorded_mpi_posts(transport, batches: list[list[str]]):
    """Within the block, every Isend/Irecv of the MPITransport appends ["send"]/["recv"]."""
    comm = transport.comm

    class Recording:
        def __getattr__(self, name):
            return getattr(comm, name)

        def Isend(self, *args, **kwargs):
            batches.append(["send"])
            return comm.Isend(*args, **kwargs)

        def Irecv(self, *args, **kwargs):
            batches.append(["recv"])
            return comm.Irecv(*args, **kwargs)

    transport.comm = Recording()
    try:
        yield
    finally:
        transport.comm = comm


@contextmanager
def recorded_channel_posts(transport, batches: list[list[str]]):
    """Within the block, every post on the HorovodTransport's gloo channel appends
    ["recv"]/["send"]."""
    channel = transport._channel
    original = channel.post

    def recording(kind, tensor, peer):
        batches.append([kind])
        return original(kind, tensor, peer)

    channel.post = recording
    try:
        yield
    finally:
        del channel.post


def posting_order(transport) -> dict:
    """The order in which the transport posts the two halves of each sendrecv (a pairwise
    exchange, then a ring shift; sizes unknown, then known), recorded where it hands them to
    the backend: torch.distributed's batch_isend_irecv, MPI's Isend/Irecv, or the posts on
    Horovod's gloo channel. Returns {"batches": [[op kind, ...] per posting], "received":
    [what each sendrecv gave]}."""
    r, p = transport.rank, transport.size
    batches: list[list[str]] = []
    if hasattr(transport, "comm"):
        recording = recorded_mpi_posts(transport, batches)
    elif hasattr(transport, "_channel"):
        assert transport.p2p == "gloo", "Horovod's gloo channel did not open"
        recording = recorded_channel_posts(transport, batches)
    else:
        recording = recorded_p2p_batches(batches)
    received = []
    with recording:
        partner = r ^ 1 if (r ^ 1) < p else r
        for dst, src in ((partner, partner), ((r + 1) % p, (r - 1) % p)):
            received.append(transport.sendrecv(rank_tensor(r, 5), dst, src, f"order.{dst}"))
            received.append(transport.sendrecv(rank_tensor(r, 5, salt=1), dst, src,
                                               f"order.known.{dst}", recv_numel=5))
    return {"batches": batches, "received": received}


def alltoall_posting_order(transport) -> dict:
    """An alltoall of variable sizes (0 for some pairs) over torch.distributed, recording
    what it hands to batch_isend_irecv. Returns {"batches": [[op kind, ...] per posting],
    "received": [the part from each rank]}."""
    r, p = transport.rank, transport.size
    batches: list[list[str]] = []
    with recorded_p2p_batches(batches):
        parts = [rank_tensor(r, variable_size(r, j), salt=j) for j in range(p)]
        received = transport.alltoall(parts, "order.alltoall")
    return {"batches": batches, "received": received}


def expected_transport_ops(rank: int, size: int) -> dict:
    """What transport_ops must return on `rank` of `size`."""
    out = {}
    for dtype in DTYPES:
        tag = str(dtype).split(".")[-1]
        src = (rank - 1) % size
        out[f"sendrecv.{tag}"] = rank_tensor(src, variable_size(src, rank), dtype)
        out[f"allgather.{tag}"] = [rank_tensor(j, variable_size(j, 0), dtype) for j in range(size)]
        out[f"alltoall.{tag}"] = [rank_tensor(j, variable_size(j, rank), dtype, salt=rank)
                                  for j in range(size)]
        out[f"broadcast.{tag}"] = rank_tensor(size - 1, 6, dtype).view(2, 3)
    out["allreduce.float32"] = sum(rank_tensor(j, 10) for j in range(size)).view(2, 5)
    out["allreduce.float64"] = sum(rank_tensor(j, 10, torch.float64) for j in range(size))
    out["allreduce.int32"] = sum(rank_tensor(j, 10, torch.int32) for j in range(size))
    # uint8 sums wrap modulo 256 (Horovod, which has no uint8 all-reduce, reduces in int64)
    out["allreduce.uint8"] = sum(rank_tensor(j, 10, torch.uint8).long()
                                 for j in range(size)).to(torch.uint8)
    out["allreduce.int16"] = sum(rank_tensor(j, 10, torch.int16) for j in range(size))
    return out


# (compressor, memory, communicator) triples exercised by the GRACE loop on every backend.
GRACE_CONFIGS = [
    ("none", "none", "allreduce"), ("fp16", "none", "allreduce"), ("randomk", "residual", "allreduce"),
    ("powersgd", "powersgd", "allreduce"), ("topk", "residual", "allgather"),
    ("threshold", "residual", "allgather"), ("dgc", "dgc", "allgather"), ("qsgd", "none", "allgather"),
    ("terngrad", "none", "allgather"), ("signsgd", "none", "allgather"), ("signum", "none", "allgather"),
    ("efsignsgd", "efsignsgd", "allgather"), ("onebit", "residual", "allgather"),
    ("natural", "none", "allgather"), ("topk", "residual", "broadcast"), ("qsgd", "none", "broadcast"),
    ("topk", "global_residual", "spardl"), ("none", "none", "dense"),
    ("topk", "global_residual", "topka"), ("topk", "global_residual", "topkdsa"),
    ("topk", "global_residual", "gtopk"), ("topk", "global_residual", "oktopk"),
    ("topk", "global_residual", "gaussiank"),
]


def tiny_regression(rank: int, steps: int = 4):
    """A two-layer model and per-rank data batches for a GRACE dist-style training loop."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    init = torch.Generator().manual_seed(1234)  # identical initial model on every rank (and thread)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.4)
    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(steps)]
    return model, batches


def train_tiny(grc, rank: int, steps: int = 4) -> list[torch.Tensor]:
    """The GRACE dist-style loop (grc.step per gradient) on tiny_regression; final params."""
    model, batches = tiny_regression(rank, steps)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for name, p in model.named_parameters():
            p.grad = grc.step(p.grad, name)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def grace_training(transport, configs=GRACE_CONFIGS, steps: int = 4) -> dict:
    """train_tiny for each (compressor, memory, communicator) config; final params by config."""
    out = {}
    for comp, mem, comm in configs:
        params = {"compressor": comp, "memory": mem, "communicator": comm, "compress_ratio": 0.3}
        out["/".join((comp, mem, comm))] = train_tiny(grace_from_params(params, transport=transport),
                                                      transport.rank, steps)
    return out


SPARDL_CASES = [(0, 0.1, 1), (1, 0.5, 1), (37, 0.2, 1), (1000, 0.05, 1), (1000, 1.0, 1),
                (999, 0.03, "all"), (1000, 1.0, "all")]


def sparse_steps(transport, params: dict, n: int, steps: int = 3, seed: int = 7,
                 integer_valued: bool = False) -> list[dict]:
    """A sparse all-reduce built from `params` for several steps on per-rank random gradients
    of n entries: per step the input, old residual, result, new residual and statistics."""
    grc = deepreduce_from_params(mechanics(params), transport=transport)
    g = torch.Generator().manual_seed(seed + transport.rank)
    records = []
    for step in range(steps):
        grad = torch.randn(n, generator=g)
        if integer_valued:
            grad = (grad * 8).round()
        old = grc.memory.residuals.get("w", torch.zeros(n)).clone()
        result = grc.step(grad, "w")
        records.append({"step": step, "grad": grad, "old_residual": old, "result": result,
                        "residual": grc.memory.residuals["w"].clone(), "stats": dict(grc.last_stats)})
    return records


def spardl_steps(transport, cases=SPARDL_CASES, steps: int = 3) -> list[dict]:
    """SparDL over several steps per case: inputs, old residuals, results and new residuals."""
    records = []
    for n, rho, teams in cases:
        d = transport.size if teams == "all" else teams
        params = {"communicator": "spardl", "compress_ratio": rho, "teams": d}
        for rec in sparse_steps(transport, params, n, steps):
            records.append({"case": (n, rho, d), **rec})
    return records


PEERS = ["dense", "topka", "topkdsa", "gtopk", "oktopk", "gaussiank"]
PEER_CASES = [(0, 0.1), (1, 0.5), (37, 0.2), (1000, 0.05), (1000, 1.0)]


def peer_params(comm: str, rho: float, wire: str | None = None) -> dict:
    """A peer's params at density `rho`, no floor, on the default wire or `wire`."""
    params = {"communicator": comm, "compress_ratio": rho}
    if comm == "dense":
        params.update(compressor="none")
    else:
        params.update(min_entries=0)  # the density as given, on these small tensors
        if wire is not None:
            params.update(wire=wire)
    if comm == "oktopk":
        params.update(oktopk_threshold_interval=2, oktopk_region_interval=3)
    return params


def peer_steps(transport, peers=PEERS, cases=PEER_CASES, steps: int = 4) -> list[dict]:
    """Every peer sparse all-reduce on every case for several steps (see sparse_steps)."""
    records = []
    for comm in peers:
        for n, rho in cases:
            for rec in sparse_steps(transport, peer_params(comm, rho), n, steps):
                records.append({"case": (comm, n, rho), **rec})
    return records


def _wait_for_last_rank(transport) -> dict:
    """Rank 0's sendrecv with the last rank: what it raised and after how many seconds."""
    import time
    from spardl_grace.transport import TransportError
    last = transport.size - 1
    start = time.monotonic()
    try:
        transport.sendrecv(torch.ones(4), last, last, "to.the.last.rank")
        raised = "nothing"
    except TransportError as exc:
        raised = type(exc).__name__
    return {"raised": raised, "seconds": torch.tensor(time.monotonic() - start),
            "timeout": torch.tensor(transport.timeout)}


def stalled_peer(transport) -> dict:
    """The ranks swap pids; then the last rank stops itself (SIGSTOP: alive, silent) and rank 0
    waits for it in a sendrecv. Rank 0 reports what it raised and after how long, then kills
    the stopped rank so that the launcher ends."""
    import os
    import signal
    pids = transport.allgather(torch.tensor([os.getpid()], dtype=torch.int64), "pids")
    if transport.rank == transport.size - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    if transport.rank != 0:
        return {}
    out = _wait_for_last_rank(transport)
    os.kill(int(pids[-1][0]), signal.SIGKILL)
    return out


def killed_peer(transport) -> dict:
    """The last rank dies without a word (os._exit); rank 0 then waits for it in a sendrecv
    and reports what it raised and after how long (if its launcher lets it live that long)."""
    import os
    transport.barrier("before.the.death")
    if transport.rank == transport.size - 1:
        os._exit(0)
    return _wait_for_last_rank(transport) if transport.rank == 0 else {}


def private_group_released(transport) -> dict:
    """Under torchrun: a transport's own process group, released as the exit handler releases
    it (torch_dist._release), is destroyed and no longer referenced, so it cannot outlive the
    interpreter; the transport was recorded for the exit handler."""
    import torch.distributed as dist

    from spardl_grace.transport import TransportError, torch_dist

    other = torch_dist.TorchDistTransport(timeout=30)
    summed = other.allreduce(torch.ones(1), "before")
    group = other.group
    torch_dist._release(other)
    try:
        dist.get_process_group_ranks(group)
        destroyed = False
    except KeyError:  # torch forgot the group
        destroyed = True
    try:
        other.allreduce(torch.ones(1), "after")
        after = ""
    except TransportError as exc:
        after = str(exc)
    return {"summed": float(summed[0]), "dropped": other._group is None,
            "destroyed": destroyed, "after": "released at interpreter exit" in after,
            "recorded": any(ref() is other for ref in torch_dist._PRIVATE_GROUPS)}
