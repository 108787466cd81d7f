"""grace_from_params: build a communicator (with its compressor and memory) from GRACE's keys.

    grc = grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                             'communicator': 'spardl', 'compress_ratio': 0.01})
    averaged = grc.step(grad, name)

Keys and defaults follow GRACE's (compressor 'none', memory 'none', communicator 'allreduce',
compress_ratio 0.01, ...), plus SparDL's and its peers'. PARAMS holds every key as one row
(default, what it accepts, what it means; the docs' parameter table is generated from it),
and ALGORITHMS every communicator: GRACE's allreduce, allgather, broadcast; the sparse
all-reduces spardl, topka, gaussiank, topkdsa, gtopk, oktopk (compressor 'topk'; memory
'global_residual', 'residual' or 'none'); and 'dense' (the uncompressed baseline). Every
unknown key, name or out-of-range value raises ValueError naming the valid choices.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import compressors as C
from . import memories as M
from .api import (
    DEFAULT_MIN_ENTRIES,
    DEFAULT_WARMUP_START,
    Compressor,
    Memory,
    SparseAllreduce,
    Synchronizer,
)
from .communicators.auto import Auto
from .communicators.dense import Dense
from .communicators.grace import Allgather, Allreduce, Broadcast
from .communicators.gtopk import RESIDUAL_RULES, GTopk
from .communicators.oktopk import PARAMS as OKTOPK_PARAMS
from .communicators.oktopk import OkTopk
from .communicators.spardl import SparDL
from .communicators.topka import GaussianK, TopkA
from .communicators.topkdsa import TopkDSA
from .compact import CompactCodec
from .params import (
    Param,
    an_int,
    boolean,
    fraction,
    int_at_least,
    number_above,
    number_at_least,
    optional,
    ranged,
)
from .payload import ChecksummedCodec, IdentityCodec, PayloadCodec
from .planner import CANDIDATE_RULE, DEFAULT_CANDIDATES, parse_candidates
from .sync import check_dense_path_keeps_momentum
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
        momentum_correction=p["momentum_correction"],
        local_clip_norm=p["local_clip_norm"],
        momentum_masking=p["momentum_masking"],
    ),
    "global_residual": lambda p: M.GlobalResidualMemory(
        momentum_correction=p["momentum_correction"],
        local_clip_norm=p["local_clip_norm"],
        momentum_masking=p["momentum_masking"],
    ),
    "dgc": lambda p: M.DgcMemory(p["momentum"], p["gradient_clipping"]),
    "efsignsgd": lambda p: M.EFSignSGDMemory(p["lr"]),
    "powersgd": lambda p: M.PowerSGDMemory(),
}

Build = Callable[
    [Compressor | None, Memory, Transport, dict[str, Any], PayloadCodec | None], Synchronizer
]


@dataclass(frozen=True)
class Algorithm:
    """A communicator: its name, its family ('grace': GRACE's compressor-memory-communicator
    trio; 'sparse': a sparse all-reduce that selects entries itself; 'dense': the
    uncompressed baseline; 'auto': the library's choice among dense, 16-bit dense and
    SparDL), how it is built from the resolved params, and what it is."""

    name: str
    family: str
    build: Build
    doc: str


def _grace(cls: Callable[[Compressor, Memory, Transport], Synchronizer]) -> Build:
    """Build GRACE's communicator `cls` from its compressor, memory and transport."""

    def build(
        c: Compressor | None, m: Memory, t: Transport, p: dict[str, Any], codec: PayloadCodec | None
    ) -> Synchronizer:
        if c is None:
            raise ValueError(f"{cls.__name__} is GRACE's communicator: it needs a compressor")
        return cls(c, m, t)

    return build


#: the params only one sparse all-reduce reads, by communicator (constructor argument=param key)
OWN_KEYS: dict[str, dict[str, str]] = {
    "gtopk": {"residual_rule": "gtopk_residual"},
    "oktopk": {
        "warmup": "oktopk_warmup_steps",
        "threshold_interval": "oktopk_threshold_interval",
        "region_interval": "oktopk_region_interval",
        "local_scale": "oktopk_local_scale",
        "global_scale": "oktopk_global_scale",
    },
    "spardl": {"teams": "teams"},
}


def _sparse(cls: Callable[..., Synchronizer], **keys: str) -> Build:
    """Build a sparse all-reduce `cls` with the density, the codec, and the params `keys`
    names (constructor argument=param key)."""

    def build(
        c: Compressor | None, m: Memory, t: Transport, p: dict[str, Any], codec: PayloadCodec | None
    ) -> Synchronizer:
        extra = {arg: p[key] for arg, key in keys.items()}
        return cls(m, t, p["compress_ratio"], codec=codec, **extra)

    return build


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "allreduce",
            "grace",
            _grace(Allreduce),
            "GRACE's: sums the compressed tensors (linear compressors)",
        ),
        Algorithm(
            "allgather",
            "grace",
            _grace(Allgather),
            "GRACE's: gathers every worker's compressed tensors",
        ),
        Algorithm(
            "broadcast",
            "grace",
            _grace(Broadcast),
            "GRACE's: each worker broadcasts its compressed tensors in turn",
        ),
        Algorithm("topka", "sparse", _sparse(TopkA), "top-k of each worker, all-gathered"),
        Algorithm(
            "gaussiank",
            "sparse",
            _sparse(GaussianK),
            "TopkA with a threshold estimated from a Gaussian fit",
        ),
        Algorithm(
            "topkdsa",
            "sparse",
            _sparse(TopkDSA),
            "top-k reduce-scatter by regions, then a sparse or dense all-gather",
        ),
        Algorithm(
            "gtopk",
            "sparse",
            _sparse(GTopk, **OWN_KEYS["gtopk"]),
            "gTop-k: the global top-k by recursive doubling (any number of workers)",
        ),
        Algorithm(
            "oktopk",
            "sparse",
            _sparse(OkTopk, **OWN_KEYS["oktopk"]),
            "Ok-Topk: thresholds reused across steps, balanced regions",
        ),
        Algorithm(
            "spardl",
            "sparse",
            _sparse(SparDL, **OWN_KEYS["spardl"]),
            "SparDL: Spar-Reduce-Scatter, global residual collection, Spar-All-Gather in d teams",
        ),
        Algorithm(
            "dense",
            "dense",
            lambda c, m, t, p, codec: Dense(m, t),
            "the uncompressed all-reduce, for comparison",
        ),
        Algorithm(
            "auto",
            "auto",
            lambda c, m, t, p, codec: Auto(
                m,
                t,
                candidates=p["auto_candidates"],
                budget=p["auto_budget"],
                measure_steps=p["auto_measure_steps"],
                replan_window=p["auto_replan_window"],
                replan_tolerance=p["auto_replan_tolerance"],
                min_entries=p["min_entries"],
            ),
            "the library's choice among dense, 16-bit dense and SparDL densities, from the "
            "measured link and compute (spardl_grace.planner)",
        ),
    )
}
GRACE_COMMUNICATORS: dict[str, Build] = {
    n: a.build for n, a in ALGORITHMS.items() if a.family == "grace"
}
SPARSE_COMMUNICATORS: dict[str, Build] = {
    n: a.build for n, a in ALGORITHMS.items() if a.family != "grace"
}
#: the sparse all-reduces, in the order the benchmarks and the docs list them
SPARSE_ALLREDUCES = tuple(n for n, a in ALGORITHMS.items() if a.family == "sparse")
COMMUNICATORS = sorted([*GRACE_COMMUNICATORS, *SPARSE_COMMUNICATORS])

#: the compressors that GRACE configs give a communicator without one (accepted, ignored), by
#: family: the sparse all-reduces select by themselves, the dense one sends everything
IGNORED_COMPRESSORS = {"sparse": ("topk",), "dense": ("none", "topk"), "auto": ("none", "topk")}
_COMPRESSOR_CLASSES = {"topk": C.TopKCompressor, "none": C.NoneCompressor}

# Compressors whose compressed tensors may be summed element-wise (all-reduce compatible).
LINEAR_COMPRESSORS = {"none", "fp16", "randomk", "powersgd"}
SPARSE_INDEX_COMPRESSORS = {"topk", "threshold", "dgc"}
SPARSE_MEMORIES = {"global_residual", "residual", "none"}
# Memories that take DGC's momentum correction and local clipping (with a sparse all-reduce).
DGC_TECHNIQUE_MEMORIES = {"global_residual", "residual"}


#: the sparse all-reduces' own wire formats (key 'wire')
WIRES = ("exact", "compact")
#: what DistributedOptimizer's ranks exchange (grace_from_params' 'exchange')
EXCHANGES = ("gradient", "update")
#: the top-k kernels GRACE's topk compressor offers (its "kernel" key)
TOPK_KERNELS = ("torch", "cupy", "rdxtopk_cuda")

PARAMS: tuple[Param, ...] = (
    Param(
        "compressor",
        "none",
        "GRACE's compressor; the sparse all-reduces take 'topk'",
        choices=tuple(COMPRESSORS),
        kind="compressor",
    ),
    Param("memory", "none", "error feedback", choices=tuple(MEMORIES), kind="memory"),
    Param(
        "communicator",
        "allreduce",
        "the communicator: one of ALGORITHMS (GRACE's, the sparse all-reduces, dense)",
        choices=tuple(ALGORITHMS),
        kind="communicator",
    ),
    ranged(
        "compress_ratio",
        None,
        "the fraction of entries kept (alias: density)",
        fraction(low_open=True),
        default_doc="0.01 (dgc: 0.3)",
    ),
    ranged(
        "threshold",
        0.01,
        "the threshold compressor's bound on magnitudes",
        number_at_least(0),
    ),
    ranged(
        "quantum_num",
        127,
        "quantisation levels (GRACE's qsgd; DeepReduce's qsgd values)",
        ((lambda v: isinstance(v, int) and 1 <= v <= 32767), "an int in 1..32767"),
    ),
    ranged("momentum", 0.9, "signum's and the dgc memory's momentum", fraction(low_open=False)),
    ranged("lr", 0.1, "efsignsgd's step size", number_above(0)),
    ranged(
        "gradient_clipping",
        False,
        "the dgc memory's gradient clipping",
        boolean(),
    ),
    ranged(
        "world_size", None, "if given, checked against the transport's", optional(int_at_least(1))
    ),
    Param(
        "kernel",
        "torch",
        "GRACE's top-k kernel (torch, cupy, rdxtopk_cuda): accepted for GRACE's configs; every "
        "one selects the same k largest magnitudes, here with the library's own selection",
        choices=TOPK_KERNELS,
        kind="top-k kernel",
    ),
    ranged("teams", 1, "SparDL's d (must divide the number of workers)", int_at_least(1)),
    ranged("powersgd_rank", 1, "PowerSGD's rank", int_at_least(1)),
    ranged(
        "seed",
        0,
        "shared random draws (randomk positions, PowerSGD's first Q, codecs)",
        an_int(),
    ),
    Param(
        "gtopk_residual",
        "exact",
        "gTop-k's residual rule: exact (conserves mass) or paper",
        choices=RESIDUAL_RULES,
        kind="gtopk_residual rule",
    ),
    ranged(
        "momentum_correction",
        0.0,
        "DGC's momentum correction m for memory global_residual or residual with a sparse "
        "all-reduce or 'auto' (0: off)",
        (fraction(low_open=False)[0], "a number in [0, 1) (0 turns it off)"),
    ),
    ranged(
        "momentum_masking",
        True,
        "DGC's momentum factor masking with momentum_correction: clear the velocity where the "
        "result was applied (False keeps it: momentum SGD exactly at density 1; 'auto' keeps "
        "it on its dense steps either way)",
        boolean(),
    ),
    ranged(
        "local_clip_norm",
        None,
        "DGC's local clipping: each worker's gradient to L2 norm c/sqrt(P) before the memory",
        optional(number_above(0)),
    ),
    Param(
        "wire",
        "compact",
        "how the sparse all-reduces send an entry when no payload codec is chosen: 'compact' "
        "(ceil(log2 block) bits of index, a bfloat16 value whose rounding error stays in the "
        "residual: 4.75 bytes on VGG-16 with 4 ranks) or 'exact' (int32 index, the value in "
        "its own dtype: 8 bytes for float32, the papers' format, to reproduce them)",
        choices=WIRES,
        kind="wire",
    ),
    ranged(
        "density_warmup_steps",
        0,
        "DGC's density warm-up for the sparse all-reduces: over each tensor's first this many "
        "steps, send density_warmup_start, then a quarter of it, ... while above "
        "compress_ratio, in equal stages (0: none)",
        int_at_least(0),
    ),
    ranged(
        "dense_warmup_steps",
        0,
        "DistributedOptimizer's and the DDP hook's (so Lightning's and Accelerate's) first this "
        "many steps are synchronised dense, with no selection and the residuals untouched "
        "(the same as their dense_warmup_steps argument; give one or the other)",
        int_at_least(0),
    ),
    ranged(
        "adam_freeze_step",
        0,
        "with torch.optim.Adam or AdamW under DistributedOptimizer or the DDP hook: the first "
        "this many steps are synchronised dense and the optimizer runs as it is, then its "
        "second moment is frozen and the update becomes linear in the synchronised gradient, "
        "so what error feedback holds back arrives with its full weight (1-bit Adam's remedy; "
        "0: off)",
        int_at_least(0),
    ),
    Param(
        "exchange",
        "gradient",
        "what DistributedOptimizer's ranks synchronise: 'gradient' (the average gradient, "
        "then the optimizer steps) or 'update' (each rank's optimizer steps on its own "
        "gradient, and the ranks apply the average of those steps, compressed with error "
        "feedback: the optimizer's state stays per rank, and what a sparse exchange holds "
        "back arrives as the movement the optimizer asked for, which an Adam-family optimizer "
        "on a sparse gradient loses)",
        choices=EXCHANGES,
        kind="exchange",
    ),
    ranged(
        "exchange_period",
        1,
        "with 'exchange': 'update': each rank's optimizer takes this many steps on its own "
        "gradients between exchanges, and the ranks then apply the average of their moves "
        "since the last one (DiLoCo's H, SparseLoCo's with a sparse communicator; 1: every "
        "step)",
        int_at_least(1),
    ),
    ranged(
        "outer_lr",
        1.0,
        "with 'exchange': 'update': the outer step's learning rate, applied to the averaged "
        "move (DiLoCo's 0.7; 1: the average as it is)",
        number_above(0),
    ),
    ranged(
        "outer_momentum",
        0.0,
        "with 'exchange': 'update': the outer step's Nesterov momentum on the averaged moves "
        "(DiLoCo's 0.9; 0: none)",
        fraction(low_open=False),
    ),
    ranged(
        "min_entries",
        DEFAULT_MIN_ENTRIES,
        "a floor for the sparse all-reduces: every tensor sends at least about this many "
        "entries a step, all of a smaller one (0: none); a small model's density then rises, "
        "a large one's is left alone",
        int_at_least(0),
    ),
    ranged(
        "density_warmup_start",
        DEFAULT_WARMUP_START,
        "the density warm-up's first stage (DGC's 0.25)",
        fraction(low_open=True),
    ),
    ranged(
        "checksum",
        False,
        "a CRC-32 on every message of a sparse all-reduce (4 bytes each), so a message changed "
        "on the way raises ValueError (DeepReduce's codecs carry one already)",
        boolean(),
    ),
    *OKTOPK_PARAMS,
    Param(
        "auto_candidates",
        DEFAULT_CANDIDATES,
        "communicator 'auto': what it chooses among, each "
        f"{CANDIDATE_RULE} (least compression first)",
        check=lambda v: isinstance(v, (list, tuple)),
        rule=f"a list of candidate names ({CANDIDATE_RULE})",
    ),
    ranged(
        "auto_budget",
        0.05,
        "communicator 'auto': how much slower than the fastest candidate's predicted step the "
        "least compressed candidate it takes may be",
        fraction(low_open=True),
    ),
    ranged(
        "auto_measure_steps",
        10,
        "communicator 'auto': dense steps measured (compute and synchronisation) before it plans",
        int_at_least(2),
    ),
    ranged(
        "auto_replan_window",
        20,
        "communicator 'auto': steps between checks of measured synchronisation against the "
        "plan's prediction (0: never re-plan)",
        int_at_least(0),
    ),
    ranged(
        "auto_replan_tolerance",
        0.25,
        "communicator 'auto': how far (relatively) the window's measured synchronisation may "
        "stray from the prediction before it probes the link and plans again",
        number_above(0),
    ),
)
#: the keys that shape 'exchange': 'update' (its period and outer step) and nothing else
OUTER_KEYS = ("exchange_period", "outer_lr", "outer_momentum")
#: the keys that configure communicator 'auto' and nothing else
AUTO_KEYS = tuple(p.key for p in PARAMS if p.key.startswith("auto_"))
DEFAULTS: dict[str, Any] = {p.key: p.default for p in PARAMS}


@dataclass(frozen=True)
class CodecKeys:
    """Keys of grace_from_params that choose the payload codec of the sparse all-reduces'
    messages, contributed by a codec package through register_codec_keys (deepreduce_compat
    registers DeepReduce's keys when it is imported). The core knows no codec package.

    defaults: each key and its default (a key the core has too, such as 'seed' or
    'quantum_num', must have the core's default: it is one setting, shared). resolve: the
    keys' values with defaults filled in, validated (ValueError naming the valid choices).
    build: the codec the resolved keys describe, or None when they choose none."""

    package: str
    defaults: Mapping[str, Any]
    resolve: Callable[[dict[str, Any]], dict[str, Any]]
    build: Callable[[dict[str, Any]], PayloadCodec | None]


_CODEC_KEYS: dict[str, CodecKeys] = {}


def register_codec_keys(keys: CodecKeys) -> None:
    """Make `keys` known to grace_from_params and resolve_params. Registering a package again
    replaces its keys; a key that another package registered, or a shared key with another
    default than the core's, raises ValueError."""
    for key, value in keys.defaults.items():
        if key in DEFAULTS and DEFAULTS[key] != value:
            raise ValueError(
                f"{keys.package} gives key {key!r} the default {value!r}, but it is "
                f"shared with the core, whose default is {DEFAULTS[key]!r}"
            )
        owner = next(
            (
                k.package
                for k in _CODEC_KEYS.values()
                if k.package != keys.package and key in k.defaults
            ),
            None,
        )
        if owner is not None:
            raise ValueError(f"{keys.package} registers key {key!r}, which {owner} registered")
    _CODEC_KEYS[keys.package] = keys


#: other names of keys: GRACE's own where this library's name differs, and 'density'
ALIASES = {"density": "compress_ratio", "compress_rank": "powersgd_rank"}
#: keys renamed into the one warm-up vocabulary (every warm-up is NAME_warmup_steps), still
#: accepted for one release with a DeprecationWarning
RENAMED = {"oktopk_warmup": "oktopk_warmup_steps"}


def _renamed(params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` with RENAMED keys under their new names, each with a DeprecationWarning;
    ValueError when both names are given."""
    out = dict(params)
    for old, new in RENAMED.items():
        if old in out:
            if new in out:
                raise ValueError(f"'{old}' is the old name of '{new}': give '{new}' alone")
            warnings.warn(
                f"grace_from_params' '{old}' is now '{new}' (every warm-up is "
                "NAME_warmup_steps); the old name goes in the next release",
                DeprecationWarning,
                stacklevel=4,
            )
            out[new] = out.pop(old)
    return out


def known_keys() -> set[str]:
    """Every key resolve_params accepts now: the core's, their ALIASES, the RENAMED keys' old
    names, and the registered codec packages' keys."""
    return set(DEFAULTS).union(ALIASES, RENAMED, *(k.defaults for k in _CODEC_KEYS.values()))


def _codec_of(p: dict[str, Any]) -> PayloadCodec | None:
    """The codec the resolved `p` chooses, if a registered package's keys choose one."""
    codecs = [
        (keys.package, codec)
        for keys in _CODEC_KEYS.values()
        if (codec := keys.build(p)) is not None
    ]
    if len(codecs) > 1:
        raise ValueError(
            f"the keys of {', '.join(n for n, _ in codecs)} each choose a payload codec: choose one"
        )
    return codecs[0][1] if codecs else None


def check_is_a_dict(params: object) -> None:
    """TypeError, showing the form, unless `params` is a dict of GRACE's keys (a JSON or
    Python string of one, or None, is a common slip)."""
    if not isinstance(params, Mapping):
        raise TypeError(
            "GRACE's parameters are a dict of keys to values, e.g. {'compressor': 'topk', "
            "'memory': 'global_residual', 'communicator': 'spardl', 'compress_ratio': 0.01}; "
            f"got {type(params).__name__}"
            + (" (parse it first)" if isinstance(params, str) else "")
        )


def resolve_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """GRACE params with defaults filled in and every value validated."""
    check_is_a_dict(params)
    return _resolve(params)[0]


def _resolve(params: Mapping[str, Any]) -> tuple[dict[str, Any], PayloadCodec | None]:
    """resolve_params(params), and the codec a registered package's keys in it choose."""
    known = known_keys()
    unknown = set(params) - known
    if unknown:
        hint = (
            ""
            if _CODEC_KEYS
            else (
                " (a codec package's keys, such as DeepReduce's "
                "'deepreduce', 'index' and 'value', are known once it "
                "is imported: import deepreduce_compat)"
            )
        )
        raise ValueError(
            f"unknown parameter(s) {sorted(unknown)}; valid keys: {sorted(known)}{hint}"
        )
    params = _renamed(params)
    p = {**DEFAULTS, **params}
    for alias, key in ALIASES.items():
        if alias in params:
            if params.get(key) not in (None, params[alias]):
                raise ValueError(f"'{alias}' is an alias of '{key}': give one of them, not both")
            p[key] = params[alias]
            del p[alias]
    for param in PARAMS:
        if param.key == "compress_ratio" and p["compress_ratio"] is None:
            p["compress_ratio"] = 0.3 if p["compressor"] == "dgc" else 0.01
        param.validate(p[param.key])
    for keys in _CODEC_KEYS.values():
        p.update(keys.resolve(p))
    chosen = _codec_of(p)
    _check_auto(p, set(params), coded=chosen is not None)
    _check_own_keys(p, {ALIASES.get(k, k) for k in params})
    _check_combination(p, coded=chosen is not None)
    if "wire" in params:
        _check_wire(p["communicator"], coded=chosen is not None)
    floor_too = ("min_entries",) if p["communicator"] != "auto" else ()  # auto's SparDL has it
    schedule = [
        k for k in ("density_warmup_steps", "density_warmup_start", *floor_too) if k in params
    ]
    if schedule and p["communicator"] not in SPARSE_ALLREDUCES:
        raise ValueError(
            f"{' and '.join(schedule)} set the density of the sparse all-reduces "
            f"({', '.join(SPARSE_ALLREDUCES)}); communicator {p['communicator']!r} has none "
            "(a GRACE compressor's density changes with set_density)"
        )
    return p, chosen


def _check_own_keys(p: dict[str, Any], given: set[str]) -> None:
    """A key that configures one communicator (SparDL's teams, Ok-Topk's intervals, gTop-k's
    residual rule) or the PowerSGD compressor (its rank) is refused with any other, rather
    than ignored."""
    for comm, keys in OWN_KEYS.items():
        stray = sorted(given & set(keys.values()))
        if stray and p["communicator"] != comm:
            raise ValueError(
                f"{', '.join(stray)} configure{'s' if len(stray) == 1 else ''} communicator "
                f"{comm!r}; communicator {p['communicator']!r} has none"
            )
    if "powersgd_rank" in given and p["compressor"] != "powersgd":
        raise ValueError(
            "powersgd_rank (GRACE's compress_rank) configures compressor 'powersgd'; "
            f"compressor {p['compressor']!r} has none"
        )


def _check_wire(comm: str, coded: bool) -> None:
    """A 'wire' given explicitly must take effect: with a sparse all-reduce and no codec."""
    if comm not in SPARSE_ALLREDUCES:
        raise ValueError(
            f"'wire' is how the sparse all-reduces ({', '.join(SPARSE_ALLREDUCES)}) send their "
            f"entries; communicator {comm!r} sends none of them"
        )
    if coded:
        raise ValueError(
            "a payload codec (a codec package's keys, such as DeepReduce's) sets the wire "
            "format itself: give 'wire' or choose a codec, not both"
        )


def refuse_update_exchange(exchange: str, where: str) -> None:
    """ValueError for 'exchange': 'update' on a path that synchronises gradients inside
    backward (the DDP hook, FSDP2): only DistributedOptimizer steps the optimizer itself."""
    if exchange == "update":
        raise ValueError(
            f"'exchange': 'update' synchronises the optimizer's step, which {where} does not "
            "take: use spardl_grace.DistributedOptimizer, or 'exchange': 'gradient'"
        )


def _check_auto(p: dict[str, Any], given: set[str], coded: bool) -> None:
    """'auto' takes its own keys, SparDL's floor, the dense warm-up and DGC's momentum
    correction and clipping (its memory's); the keys that tune one fixed algorithm (a
    density, a warm-up of it, a wire, a codec, the optimizer-aware modes) are refused rather
    than ignored."""
    if p["communicator"] != "auto":
        own = sorted(given & set(AUTO_KEYS))
        if own:
            raise ValueError(
                f"{', '.join(own)} configure communicator 'auto'; communicator "
                f"{p['communicator']!r} has none"
            )
        return
    parse_candidates(p["auto_candidates"])
    fixed = sorted(
        given
        & {
            "compress_ratio",
            "density",
            "density_warmup_steps",
            "density_warmup_start",
            "teams",
            "adam_freeze_step",
        }
    )
    if fixed:
        raise ValueError(
            f"communicator 'auto' chooses the density itself, so it takes no {', '.join(fixed)}: "
            "name its choices in 'auto_candidates' (or choose a communicator such as 'spardl')"
        )
    if p["exchange"] != "gradient":
        raise ValueError(
            "communicator 'auto' synchronises gradients: leave 'exchange' at 'gradient'"
        )
    check_dense_path_keeps_momentum(p["momentum_correction"], p["dense_warmup_steps"], 0)
    if coded:
        raise ValueError(
            "communicator 'auto' sends SparDL on the compact wire: choose no payload codec "
            "(DeepReduce: 'deepreduce': None)"
        )
    if p["memory"] not in SPARSE_MEMORIES:
        raise ValueError(
            f"communicator 'auto' needs memory in {sorted(SPARSE_MEMORIES)} (the candidates "
            f"share it; 'global_residual' keeps SparDL's residuals), got {p['memory']!r}"
        )
    if p["compressor"] not in IGNORED_COMPRESSORS["auto"]:
        raise ValueError(
            f"communicator 'auto' chooses its compression itself: use compressor 'none' "
            f"(or 'topk', ignored), got {p['compressor']!r}"
        )


#: the compressors that work only with the memory of their name, and why
PAIRED = {
    "powersgd": "the memory keeps the compressor's error feedback",
    "efsignsgd": "the compressor's aggregate divides by lr what only that memory multiplies "
    "by lr: alone, either one scales the gradient by lr or 1/lr",
}


def _check_combination(p: dict[str, Any], coded: bool) -> None:
    comp, mem, comm = p["compressor"], p["memory"], p["communicator"]
    if not p["momentum_masking"] and not p["momentum_correction"]:
        raise ValueError(
            "momentum_masking=False keeps the velocity of momentum correction, which is off: "
            "set momentum_correction too, or leave momentum_masking at True"
        )
    outer = sorted(k for k in OUTER_KEYS if p[k] != DEFAULTS[k])
    if outer and p["exchange"] != "update":
        raise ValueError(
            f"{', '.join(outer)} shape the exchange of the ranks' optimizer steps: set "
            "'exchange': 'update' too (with 'gradient' the ranks average every gradient)"
        )
    sparse = comm in SPARSE_COMMUNICATORS or comm == "auto"
    for key in ("momentum_correction", "local_clip_norm"):
        if p[key] and (not sparse or mem not in DGC_TECHNIQUE_MEMORIES):
            raise ValueError(
                f"{key} is an option of memory {sorted(DGC_TECHNIQUE_MEMORIES)} with a "
                f"sparse all-reduce ({', '.join(sorted(SPARSE_COMMUNICATORS))}) or 'auto'; "
                f"got memory {mem!r}, communicator {comm!r} (GRACE's 'dgc' memory has its "
                "own momentum)"
            )
    if comm == "auto":
        return
    if p["exchange"] == "update" and p["momentum_correction"]:
        raise ValueError(
            "'exchange': 'update' sends the optimizer's own step, which already carries its "
            "momentum: leave momentum_correction at 0"
        )
    if p["adam_freeze_step"] and comm == "dense":
        raise ValueError(
            "'adam_freeze_step' makes Adam's update linear for a compressed gradient; "
            "communicator 'dense' sends it whole, so leave it at 0"
        )
    if p["checksum"] and comm not in SPARSE_ALLREDUCES:
        raise ValueError(
            f"'checksum' guards the messages of the sparse all-reduces "
            f"({', '.join(SPARSE_ALLREDUCES)}); communicator {comm!r} sends none of them"
        )
    if coded and comm == "dense":
        raise ValueError(
            "communicator 'dense' sends no sparse payload for a codec to code: "
            "choose no codec (DeepReduce: 'deepreduce': None) or a sparse "
            "communicator"
        )
    if comm == "dense":
        if comp not in IGNORED_COMPRESSORS["dense"]:
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
        if comp not in IGNORED_COMPRESSORS["sparse"]:
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
    for name in PAIRED:
        if (mem == name) != (comp == name):
            raise ValueError(
                f"compressor {name!r} and memory {name!r} go together ({PAIRED[name]}), "
                f"got compressor {comp!r}, memory {mem!r}"
            )
    if mem == "dgc" and comp not in SPARSE_INDEX_COMPRESSORS:
        raise ValueError(
            f"memory 'dgc' masks sent indices: use a compressor in "
            f"{sorted(SPARSE_INDEX_COMPRESSORS)}, got {comp!r}"
        )


def grace_from_params(
    params: dict[str, Any], transport: Transport | None = None, codec: PayloadCodec | None = None
) -> Synchronizer:
    """Build the communicator described by GRACE-style `params` (see the module docstring).

    'compressor' and 'memory' may be objects instead of names: a GRACE user's own (GRACE's
    interface is enough) or one of this library's. transport=None uses the active backend
    (Horovod, else torch.distributed, else mpirun); spardl_grace.transport.run_local gives a
    transport per thread for simulations. codec: the PayloadCodec that codes a sparse
    all-reduce's messages (None: the identity, or the one a registered codec package's keys
    in `params` choose, such as DeepReduce's)."""
    check_is_a_dict(params)
    if codec is not None and not isinstance(codec, PayloadCodec):
        raise TypeError(
            f"codec must be a spardl_grace.payload.PayloadCodec, got {type(codec).__name__}"
        )
    given = {
        key: params[key]
        for key in ("compressor", "memory")
        if key in params and not isinstance(params[key], str)
    }
    sparse = params.get("communicator", DEFAULTS["communicator"]) in SPARSE_COMMUNICATORS
    # Objects stand aside while the names are validated; the communicator checks them itself.
    # Beside a name that needs its partner (powersgd, efsignsgd), an object stands in as that.
    stand_in = {
        key: partner
        if (partner := params.get(other)) in PAIRED
        else ("topk" if sparse and key == "compressor" else "none")
        for key, other in (("compressor", "memory"), ("memory", "compressor"))
    }
    p, chosen = _resolve({**params, **{key: stand_in[key] for key in given}})
    if codec is not None and chosen is not None:
        raise ValueError(
            "give the codec as codec= or choose it with a codec package's keys "
            f"({chosen.name}), not both"
        )
    comm = p["communicator"]
    if codec is not None and comm not in SPARSE_ALLREDUCES:
        raise ValueError(
            f"codec= codes the messages of the sparse all-reduces "
            f"({', '.join(sorted(SPARSE_ALLREDUCES))}); "
            f"communicator {comm!r} sends none"
        )
    # With a GRACE communicator, DeepReduce's keys choose wrappers of the compressor instead
    # (deepreduce_compat.deepreduce_from_params applies them).
    codec = codec if codec is not None else chosen
    if codec is not None and "wire" in params:
        _check_wire(comm, coded=True)
    if codec is None and p["wire"] == "compact" and comm in SPARSE_ALLREDUCES:
        codec = CompactCodec()
    if p["checksum"]:
        codec = ChecksummedCodec(codec if codec is not None else IdentityCodec())
    if transport is None:
        transport = default_transport()
    if p["world_size"] is not None and p["world_size"] != transport.size:
        raise ValueError(
            f"world_size {p['world_size']} does not match the transport's {transport.size} ranks"
        )
    algorithm = ALGORITHMS[comm]
    compressor = None
    if algorithm.family == "grace":
        compressor = (
            given["compressor"] if "compressor" in given else COMPRESSORS[p["compressor"]](p)
        )
    elif "compressor" in given:
        _check_ignored_compressor(algorithm, given["compressor"])
    memory = given["memory"] if "memory" in given else MEMORIES[p["memory"]](p)
    built = algorithm.build(compressor, memory, transport, p, codec)
    built.adam_freeze_step = p["adam_freeze_step"]
    built.dense_warmup_steps = p["dense_warmup_steps"]
    built.exchange = p["exchange"]
    for key in OUTER_KEYS:
        setattr(built, key, p[key])
    if algorithm.family == "sparse" and isinstance(built, SparseAllreduce):
        built.set_density_warmup(p["density_warmup_steps"], p["density_warmup_start"])
        built.set_min_entries(p["min_entries"])
    return built


def _check_ignored_compressor(algorithm: Algorithm, compressor: Any) -> None:
    """A sparse all-reduce selects its entries itself and the dense one sends everything, so
    neither has a compressor: the compressors GRACE users' configs give them
    (IGNORED_COMPRESSORS), by name or as this library's compressor object, are accepted; any
    other compressor would be silently ignored and is refused."""
    names = IGNORED_COMPRESSORS[algorithm.family]
    if not isinstance(compressor, tuple(_COMPRESSOR_CLASSES[n] for n in names)):
        what = (
            "sends the uncompressed gradient"
            if algorithm.family == "dense"
            else "selects its entries itself, while it communicates (exact top-k per block)"
        )
        raise ValueError(
            f"{algorithm.name} {what}, so it would ignore the compressor "
            f"{type(compressor).__name__}: give it this library's compressor "
            f"{' or '.join(repr(n) for n in names)}, or run your compressor over 'allgather', "
            "'allreduce' or 'broadcast'"
        )
