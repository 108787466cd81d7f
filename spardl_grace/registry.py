"""grace_from_params: build a communicator (with its compressor and memory) from GRACE's keys.

    grc = grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                             'communicator': 'spardl', 'compress_ratio': 0.01})
    averaged = grc.step(grad, name)

Keys and defaults follow GRACE: compressor 'none', memory 'none', communicator 'allreduce',
compress_ratio 0.01 (0.3 for dgc), threshold 0.01, quantum_num 127, momentum 0.9, lr 0.1,
gradient_clipping False; plus world_size (checked against the transport), 'density' (alias of
compress_ratio), 'teams' (SparDL's d, default 1), 'powersgd_rank' (default 1), 'seed'
(default 0, for shared random draws), 'gtopk_residual' ('exact' or 'paper', default 'exact'),
DGC's 'momentum_correction' (m in [0, 1), default 0: off) and 'local_clip_norm' (None: off) for
memory 'global_residual' with a sparse all-reduce (see spardl_grace.memories.residual)
and Ok-Topk's 'oktopk_warmup' (0), 'oktopk_threshold_interval' (32), 'oktopk_region_interval'
(64), 'oktopk_local_scale' (1.012), 'oktopk_global_scale' (1.008). Every unknown key, name or
out-of-range value raises ValueError naming the valid choices.

Communicators: GRACE's allreduce, allgather, broadcast; the sparse all-reduces spardl, topka,
topkdsa, gtopk, oktopk, gaussiank (compressor 'topk'; memory 'global_residual', 'residual'
or 'none'); and 'dense' (compressor 'none', the uncompressed baseline).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepreduce_compat.codec import DEFAULTS as DEEPREDUCE_DEFAULTS
from deepreduce_compat.codec import codec_from_params
from deepreduce_compat.codec import resolve as resolve_deepreduce

from . import compressors as C
from . import memories as M
from .api import Communicator, Compressor, Memory
from .communicators.dense import Dense
from .communicators.grace import Allgather, Allreduce, Broadcast
from .communicators.gtopk import RESIDUAL_RULES, GTopk
from .communicators.oktopk import DEFAULTS as OKTOPK_DEFAULTS
from .communicators.oktopk import OkTopk
from .communicators.oktopk import check_params as check_oktopk_params
from .communicators.spardl import SparDL
from .communicators.topka import GaussianK, TopkA
from .communicators.topkdsa import TopkDSA
from .transport import Transport, default_transport

COMPRESSORS: dict[str, Callable[[dict], Compressor]] = {
    "none": lambda p: C.NoneCompressor(),
    "fp16": lambda p: C.FP16Compressor(),
    "topk": lambda p: C.TopKCompressor(p["compress_ratio"]),
    "randomk": lambda p: C.RandomKCompressor(p["compress_ratio"], seed=p["seed"]),
    "threshold": lambda p: C.ThresholdCompressor(p["threshold"]),
    "dgc": lambda p: C.DgcCompressor(p["compress_ratio"], seed=p["seed"]),
    "qsgd": lambda p: C.QSGDCompressor(p["quantum_num"], seed=p["seed"]),
    "terngrad": lambda p: C.TernGradCompressor(seed=p["seed"]),
    "signsgd": lambda p: C.SignSGDCompressor(),
    "signum": lambda p: C.SignumCompressor(p["momentum"]),
    "efsignsgd": lambda p: C.EFSignSGDCompressor(p["lr"]),
    "onebit": lambda p: C.OneBitCompressor(),
    "natural": lambda p: C.NaturalCompressor(seed=p["seed"]),
    "powersgd": lambda p: C.PowerSGDCompressor(p["powersgd_rank"], seed=p["seed"]),
}

MEMORIES: dict[str, Callable[[dict], Memory]] = {
    "none": lambda p: M.NoneMemory(),
    "residual": lambda p: M.ResidualMemory(
        momentum_correction=p["momentum_correction"], local_clip_norm=p["local_clip_norm"]
    ),
    "global_residual": lambda p: M.GlobalResidualMemory(
        momentum_correction=p["momentum_correction"], local_clip_norm=p["local_clip_norm"]
    ),
    "dgc": lambda p: M.DgcMemory(p["momentum"], p["gradient_clipping"]),
    "efsignsgd": lambda p: M.EFSignSGDMemory(p["lr"]),
    "powersgd": lambda p: M.PowerSGDMemory(),
}

GRACE_COMMUNICATORS = {"allreduce": Allreduce, "allgather": Allgather, "broadcast": Broadcast}
SPARSE_COMMUNICATORS: dict[str, Callable[..., Communicator]] = {
    "spardl": lambda c, m, t, p, codec: SparDL(
        c, m, t, p["compress_ratio"], teams=p["teams"], codec=codec
    ),
    "dense": lambda c, m, t, p, codec: Dense(c, m, t),
    "topka": lambda c, m, t, p, codec: TopkA(c, m, t, p["compress_ratio"], codec=codec),
    "gaussiank": lambda c, m, t, p, codec: GaussianK(c, m, t, p["compress_ratio"], codec=codec),
    "topkdsa": lambda c, m, t, p, codec: TopkDSA(c, m, t, p["compress_ratio"], codec=codec),
    "gtopk": lambda c, m, t, p, codec: GTopk(
        c, m, t, p["compress_ratio"], residual_rule=p["gtopk_residual"], codec=codec
    ),
    "oktopk": lambda c, m, t, p, codec: OkTopk(
        c,
        m,
        t,
        p["compress_ratio"],
        warmup=p["oktopk_warmup"],
        threshold_interval=p["oktopk_threshold_interval"],
        region_interval=p["oktopk_region_interval"],
        local_scale=p["oktopk_local_scale"],
        global_scale=p["oktopk_global_scale"],
        codec=codec,
    ),
}
COMMUNICATORS = sorted([*GRACE_COMMUNICATORS, *SPARSE_COMMUNICATORS])

# Compressors whose compressed tensors may be summed element-wise (all-reduce compatible).
LINEAR_COMPRESSORS = {"none", "fp16", "randomk", "powersgd"}
SPARSE_INDEX_COMPRESSORS = {"topk", "threshold", "dgc"}
SPARSE_MEMORIES = {"global_residual", "residual", "none"}
# Memories that take DGC's momentum correction and local clipping (with a sparse all-reduce).
DGC_TECHNIQUE_MEMORIES = {"global_residual", "residual"}

DEFAULTS: dict[str, Any] = {
    "compressor": "none",
    "memory": "none",
    "communicator": "allreduce",
    "compress_ratio": None,
    "threshold": 0.01,
    "quantum_num": 127,
    "momentum": 0.9,
    "lr": 0.1,
    "gradient_clipping": False,
    "world_size": None,
    "teams": 1,
    "powersgd_rank": 1,
    "seed": 0,
    "gtopk_residual": "exact",
    "momentum_correction": 0.0,
    "local_clip_norm": None,
    **{f"oktopk_{k}": v for k, v in OKTOPK_DEFAULTS.items()},
}
KNOWN_KEYS = set(DEFAULTS) | set(DEEPREDUCE_DEFAULTS) | {"density"}


def _choice(kind: str, value: Any, valid) -> str:
    if value not in valid:
        raise ValueError(f"unknown {kind} {value!r}; valid choices: {', '.join(sorted(valid))}")
    return value


def _in_range(key: str, value: Any, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"{key} must be {rule}, got {value!r}")


def resolve_params(params: dict[str, Any]) -> dict[str, Any]:
    """GRACE params with defaults filled in and every value validated."""
    unknown = set(params) - KNOWN_KEYS
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {sorted(unknown)}; valid keys: {sorted(KNOWN_KEYS)}"
        )
    p = {**DEFAULTS, **params}
    if "density" in params:
        if params.get("compress_ratio") not in (None, params["density"]):
            raise ValueError(
                "'density' is an alias of 'compress_ratio': give one of them, not both"
            )
        p["compress_ratio"] = params["density"]
    _choice("compressor", p["compressor"], COMPRESSORS)
    _choice("memory", p["memory"], MEMORIES)
    _choice("communicator", p["communicator"], COMMUNICATORS)
    if p["compress_ratio"] is None:
        p["compress_ratio"] = 0.3 if p["compressor"] == "dgc" else 0.01
    ratio = p["compress_ratio"]
    _in_range(
        "compress_ratio",
        ratio,
        isinstance(ratio, (int, float)) and 0 < ratio <= 1,
        "a number in (0, 1]",
    )
    _in_range(
        "threshold",
        p["threshold"],
        isinstance(p["threshold"], (int, float)) and p["threshold"] >= 0,
        "a number >= 0",
    )
    _in_range(
        "quantum_num",
        p["quantum_num"],
        isinstance(p["quantum_num"], int) and 1 <= p["quantum_num"] <= 32767,
        "an int in 1..32767",
    )
    _in_range(
        "momentum",
        p["momentum"],
        isinstance(p["momentum"], (int, float)) and 0 <= p["momentum"] < 1,
        "a number in [0, 1)",
    )
    _in_range("lr", p["lr"], isinstance(p["lr"], (int, float)) and p["lr"] > 0, "a number > 0")
    _in_range(
        "gradient_clipping",
        p["gradient_clipping"],
        isinstance(p["gradient_clipping"], bool),
        "True or False",
    )
    _in_range("teams", p["teams"], isinstance(p["teams"], int) and p["teams"] >= 1, "an int >= 1")
    _in_range(
        "powersgd_rank",
        p["powersgd_rank"],
        isinstance(p["powersgd_rank"], int) and p["powersgd_rank"] >= 1,
        "an int >= 1",
    )
    _choice("gtopk_residual rule", p["gtopk_residual"], RESIDUAL_RULES)
    mc = p["momentum_correction"]
    _in_range(
        "momentum_correction",
        mc,
        isinstance(mc, (int, float)) and not isinstance(mc, bool) and 0 <= mc < 1,
        "a number in [0, 1) (0 turns it off)",
    )
    clip = p["local_clip_norm"]
    _in_range(
        "local_clip_norm",
        clip,
        clip is None
        or (isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0),
        "None (off) or a number > 0",
    )
    check_oktopk_params(**{key: p[f"oktopk_{key}"] for key in OKTOPK_DEFAULTS})
    p.update(resolve_deepreduce(p))
    _check_combination(p)
    return p


def _check_combination(p: dict[str, Any]) -> None:
    comp, mem, comm = p["compressor"], p["memory"], p["communicator"]
    for key in ("momentum_correction", "local_clip_norm"):
        if p[key] and (comm not in SPARSE_COMMUNICATORS or mem not in DGC_TECHNIQUE_MEMORIES):
            raise ValueError(
                f"{key} is an option of memory {sorted(DGC_TECHNIQUE_MEMORIES)} with a "
                f"sparse all-reduce ({', '.join(sorted(SPARSE_COMMUNICATORS))}); got "
                f"memory {mem!r}, communicator {comm!r} (GRACE's 'dgc' memory has its "
                "own momentum)"
            )
    if p["deepreduce"] is not None and comm == "dense":
        raise ValueError(
            "communicator 'dense' sends no sparse payload for DeepReduce to code: "
            "set 'deepreduce' to None or choose a sparse communicator"
        )
    if comm == "dense":
        if comp not in ("none", "topk"):
            raise ValueError(
                f"communicator 'dense' sends the uncompressed gradient: use compressor "
                f"'none' (or 'topk', ignored), got {comp!r}"
            )
        if mem not in SPARSE_MEMORIES:
            raise ValueError(
                f"communicator 'dense' needs memory in {sorted(SPARSE_MEMORIES)}, got {mem!r}"
            )
        return
    if comm in SPARSE_COMMUNICATORS:
        if comp != "topk":
            raise ValueError(
                f"communicator {comm!r} selects entries itself (exact top-k per block): "
                f"use compressor 'topk', got {comp!r}"
            )
        if mem not in SPARSE_MEMORIES:
            raise ValueError(
                f"communicator {comm!r} needs memory in {sorted(SPARSE_MEMORIES)}, got {mem!r}"
            )
        return
    if mem == "global_residual":
        raise ValueError(
            f"memory 'global_residual' works with {sorted(SPARSE_COMMUNICATORS)}; "
            f"with communicator {comm!r} use 'residual'"
        )
    if comm == "allreduce" and comp not in LINEAR_COMPRESSORS:
        raise ValueError(
            f"communicator 'allreduce' sums compressed tensors, valid only for compressors "
            f"{sorted(LINEAR_COMPRESSORS)}; use 'allgather' for {comp!r}"
        )
    if comp == "powersgd" and comm != "allreduce":
        raise ValueError(
            "compressor 'powersgd' communicates inside compress: use communicator 'allreduce'"
        )
    if (mem == "powersgd") != (comp == "powersgd"):
        raise ValueError("compressor 'powersgd' and memory 'powersgd' go together")
    if mem == "dgc" and comp not in SPARSE_INDEX_COMPRESSORS:
        raise ValueError(
            f"memory 'dgc' masks sent indices: use a compressor in "
            f"{sorted(SPARSE_INDEX_COMPRESSORS)}, got {comp!r}"
        )


def grace_from_params(params: dict[str, Any], transport: Transport | None = None) -> Communicator:
    """Build the communicator described by GRACE-style `params` (see the module docstring).

    'compressor' and 'memory' may be objects instead of names: a GRACE user's own (GRACE's
    interface is enough) or one of this library's. transport=None uses the active backend
    (Horovod, else torch.distributed, else mpirun); spardl_grace.transport.run_local gives a
    transport per thread for simulations."""
    given = {
        key: params[key]
        for key in ("compressor", "memory")
        if key in params and not isinstance(params[key], str)
    }
    sparse = params.get("communicator", DEFAULTS["communicator"]) in SPARSE_COMMUNICATORS
    # Objects stand aside while the names are validated; the communicator checks them itself.
    stand_in = {"compressor": "topk" if sparse else "none", "memory": "none"}
    p = resolve_params({**params, **{key: stand_in[key] for key in given}})
    if transport is None:
        transport = default_transport()
    if p["world_size"] is not None and p["world_size"] != transport.size:
        raise ValueError(
            f"world_size {p['world_size']} does not match the transport's {transport.size} ranks"
        )
    compressor = given["compressor"] if "compressor" in given else COMPRESSORS[p["compressor"]](p)
    memory = given["memory"] if "memory" in given else MEMORIES[p["memory"]](p)
    comm = p["communicator"]
    if comm in GRACE_COMMUNICATORS:
        return GRACE_COMMUNICATORS[comm](compressor, memory, transport)
    return SPARSE_COMMUNICATORS[comm](compressor, memory, transport, p, codec_from_params(p))
