"""Horovod 0.28's DistributedOptimizer keywords, with Horovod's meaning, for
spardl_grace.DistributedOptimizer: a Horovod script changes the optimizer's name and nothing
else.

    compression     Compression.none; Compression.fp16: 16-bit values on the wire (the compact
                    wire, or GRACE's 'fp16' compressor), refused where the communicator has
                    another wire, saying how to get one
    op              Average (0) and Sum (1); Adasum, Min, Max, Product refused
    gradient_predivide_factor   gradients times 1/f before the synchronisation and f after
                    (Horovod: 1/f before the sum, f/size after), with op=Average only
    groups, num_groups          Horovod's explicit grouping, as buckets
    sparse_as_dense sparse gradients (nn.Embedding(sparse=True)) made dense; without it they
                    are refused (Horovod would all-gather them)
    process_set     the global set only

Horovod's values are plain ints (ops) and classes (compressors), so nothing here imports
Horovod: the same script runs under torchrun and mpirun.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .api import Synchronizer

#: Horovod's reduction ops (horovod.torch.Average, Sum, Adasum, Min, Max, Product)
AVERAGE, SUM = 0, 1
OP_NAMES = {0: "Average", 1: "Sum", 2: "Adasum", 3: "Min", 4: "Max", 5: "Product"}

#: grace_from_params keys of the communicator a Horovod script gets without naming one
DEFAULT_PARAMS: dict[str, Any] = {
    "compressor": "topk",
    "memory": "global_residual",
    "communicator": "spardl",
    "compress_ratio": 0.01,
}


def compression_name(compression: Any) -> str:
    """'none' or 'fp16' for Horovod's Compression.none / Compression.fp16 (or None);
    ValueError naming the valid choices otherwise."""
    if compression is None:
        return "none"
    name = getattr(compression, "__name__", type(compression).__name__)
    if name == "NoneCompressor":
        return "none"
    if name == "FP16Compressor":
        return "fp16"
    raise ValueError(
        f"compression={compression!r} is not one of Horovod's Compression.none or "
        "Compression.fp16. spardl_grace's compression is its communicator: pass "
        "grace=grace_from_params({...}) (GRACE's keys) instead"
    )


def default_grace() -> Synchronizer:
    """The communicator for a script that names none: SparDL at density 0.01 with
    grace_from_params' defaults (the floor of entries, the compact wire, whose bfloat16 values
    also meet Horovod's fp16 compression) on the active backend."""
    from .registry import grace_from_params

    return grace_from_params(dict(DEFAULT_PARAMS))


def check_compression(compression: str, grace: Synchronizer) -> None:
    """ValueError when Horovod's fp16 compression is asked of a communicator whose values are
    not 16-bit on the wire, saying how to build one that is."""
    if compression != "fp16":
        return
    from .communicators.auto import Auto
    from .compact import CompactCodec
    from .compressors.fp16 import FP16Compressor

    if isinstance(getattr(grace, "codec", None), CompactCodec):
        return
    if isinstance(getattr(grace, "compressor", None), FP16Compressor):
        return
    if isinstance(grace, Auto):  # its candidates: SparDL on the compact wire, dense in
        if "dense" not in grace.candidates.split(","):  # bfloat16, and float32 dense
            return
        raise ValueError(
            "compression=Compression.fp16 asks for 16-bit values on the wire, and 'auto' may "
            "choose 'dense' (float32): leave it out of 'auto_candidates' (e.g. "
            "'auto_candidates': ['dense16', 'spardl@0.1', 'spardl@0.03', 'spardl@0.01', "
            "'spardl@0.003', 'spardl@0.001']), or drop compression="
        )
    raise ValueError(
        "compression=Compression.fp16 asks for 16-bit values on the wire, but this "
        f"communicator ({type(grace).__name__}) sends full-precision values: build it with "
        "'wire': 'compact' (a sparse all-reduce: bfloat16 values, bit-packed indices) or "
        "GRACE's {'compressor': 'fp16', 'memory': 'none', 'communicator': 'allreduce'}, or "
        "drop compression="
    )


def scale_factors(
    op: Any, gradient_predivide_factor: float, world_size: int
) -> tuple[float, float]:
    """(before, after): what the gradients are multiplied by before the synchronisation (an
    average) and after it, so that the result is Horovod's for `op`."""
    if op is None:
        op = AVERAGE
    if isinstance(op, bool) or op not in (AVERAGE, SUM):
        name = OP_NAMES.get(op, repr(op)) if isinstance(op, int) else repr(op)
        raise ValueError(
            f"op={name} is not supported: spardl_grace averages sparse gradients; valid ops are "
            "hvd.Average and hvd.Sum (Adasum is Horovod's own adaptive summation, run it with "
            "hvd.DistributedOptimizer)"
        )
    factor = gradient_predivide_factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {factor!r}")
    if factor != 1.0 and op != AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average (as Horovod)")
    after = float(factor) * (world_size if op == SUM else 1)
    return 1.0 / float(factor), after


def check_process_set(process_set: Any) -> None:
    """Only Horovod's global process set (or None): spardl_grace synchronises over every rank
    of its transport."""
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        return
    raise ValueError(
        f"process_set={process_set!r}: only the global process set is supported "
        "(spardl_grace synchronises over every rank of its transport); run one job per set"
    )


def parameter_groups(
    groups: int | Sequence[Sequence[torch.Tensor]] | None,
    num_groups: int,
    in_order: list[torch.nn.Parameter],
) -> list[list[torch.nn.Parameter]] | None:
    """Horovod's explicit groups as lists of parameters: `groups` an int n (or the deprecated
    num_groups): the parameters (in the optimizer's order) cut into n near-equal runs, as
    Horovod's split_list; a list of lists: those, each parameter in no list a group of its
    own. None: no explicit groups."""
    if num_groups:
        if not isinstance(num_groups, int) or num_groups < 0:
            raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}")
        if groups is None:
            groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups <= 0:
            raise ValueError(
                "groups should be a positive integer or a list of lists of torch.Tensor, "
                f"got {groups!r}"
            )
        d, r = divmod(len(in_order), groups)
        runs = [in_order[i * d + min(i, r) : (i + 1) * d + min(i + 1, r)] for i in range(groups)]
        return [run for run in runs if run]
    if not isinstance(groups, (list, tuple)):
        raise ValueError(
            f"groups should be a positive integer or a list of lists of torch.Tensor, "
            f"got {type(groups).__name__}"
        )
    known = set(in_order)
    seen: set[torch.Tensor] = set()
    out: list[list[torch.nn.Parameter]] = []
    for group in groups:
        members = list(group)
        for p in members:
            if not isinstance(p, torch.Tensor):
                raise ValueError("groups must consist of torch.Tensor")
            if p in seen:
                raise ValueError("a parameter can only appear once in groups")
            if p not in known:
                raise ValueError("groups names a tensor that is not a parameter of the optimizer")
            seen.add(p)
        if members:
            out.append(members)
    out.extend([p] for p in in_order if p not in seen)
    return out
