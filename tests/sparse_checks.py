"""Running a sparse all-reduce for a few steps on the local backend, and the checks every
sparse all-reduce must pass (shared by the SparDL and peer tests)."""
from __future__ import annotations

import torch

from deepreduce_compat import deepreduce_from_params
from spardl_grace.transport import run_local
from spardl_grace.registry import SPARSE_ALLREDUCES
from spardl_grace.transport import CountingTransport


# The algorithms' mechanics on toy tensors: no floor on the entries sent (the library's default
# floor, min_entries 2048, would send these tensors of a few thousand entries nearly dense).
def mechanics(params: dict) -> dict:
    """`params` over the tests' base: global residual, topk, and no floor for a sparse
    all-reduce."""
    base = {"memory": "global_residual", "compressor": "topk"}
    if params.get("communicator") in SPARSE_ALLREDUCES:
        base["min_entries"] = 0
    return {**base, **params}


def run_steps(size, params, n=None, steps=3, integer_valued=False, counting=False, grads=None):
    """Per rank, per step: compensated input, result, new residual, stats and (with counting)
    the messages sent. Gradients are random (seeded per rank) or given as grads[rank][step]."""
    def fn(t):
        transport = CountingTransport(t) if counting else t
        grc = deepreduce_from_params(mechanics(params), transport=transport)
        g = torch.Generator().manual_seed(1000 + t.rank)
        records = []
        for step in range(steps):
            if grads is not None:
                grad = grads[t.rank][step].clone()
            else:
                grad = torch.randn(n, generator=g)
                if integer_valued:
                    grad = (grad * 8).round()
            old = grc.memory.residuals.get("w", torch.zeros_like(grad)).clone()
            if counting:
                transport.reset()
            result = grc.step(grad, "w")
            records.append({"compensated": grad + old, "result": result,
                            "residual": grc.memory.residuals["w"].clone(),
                            "stats": dict(grc.last_stats),
                            "messages": algorithm_messages(transport) if counting else None,
                            "grc": grc})
        return records
    return run_local(size, fn)


def check_consistent_and_conserving(per_rank, size, atol=1e-4):
    for step in range(len(per_rank[0])):
        result = per_rank[0][step]["result"]
        for rank in range(1, size):
            assert torch.equal(per_rank[rank][step]["result"], result), f"rank {rank} step {step}"
        compensated = sum(r[step]["compensated"] for r in per_rank)
        kept = sum(r[step]["residual"] for r in per_rank)
        assert torch.allclose(compensated, size * result + kept, atol=atol), f"step {step}"


def check_exact_dense_average(per_rank, size):
    """Every step's result is exactly the average of the compensated inputs and no residual is
    left. Use integer-valued gradients: every partial sum is then exact, in any order."""
    for step in range(len(per_rank[0])):
        total = sum(r[step]["compensated"] for r in per_rank)
        assert torch.equal(per_rank[0][step]["result"] * size, total), f"step {step}"
        for r in per_rank:
            assert torch.count_nonzero(r[step]["residual"]) == 0, f"step {step}"


def algorithm_messages(transport: CountingTransport) -> list:
    """The algorithm's own messages: without the ranks' agreement on a new name (control
    traffic that tests/test_agreement.py counts), so they can be held against its formulas."""
    return [m for m in transport.messages if m.phase != "agree"]


def sent_bytes(record, phases=None):
    return sum(m.bytes_sent for m in record["messages"] if phases is None or m.phase in phases)
