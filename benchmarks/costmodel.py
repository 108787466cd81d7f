"""Cost formulas and an alpha-beta network model for every sparse all-reduce of the project.

Three things, all pure functions (no communication), so tests can check them:

* `formula_bytes`: the bytes a rank sends per step by each algorithm's cost formula
  (../shared/reference/ALGORITHMS.md), to hold measurements against.
* `ops_from_messages`: a rank's recorded message trace (CountingTransport) as a list of `Op`s,
  and `synthesize`: the same list generated for any P (up to 1024 and beyond) from the
  algorithm's schedule, with the few data-dependent quantities (`Calibration`) measured on
  real traces at small P.
* `predict_seconds`: the time of a list of Ops under an alpha-beta `Network`, flat or
  hierarchical (ranks_per_node ranks share a node with their own alpha and beta).

Costs per op (bytes b, P ranks, link parameters alpha, beta in s and s/byte):
  p2p exchange     alpha + beta * max(sent, received)           (full duplex)
  alltoall         per link class: peers * alpha + beta * max(sent, received); classes overlap
  allgather        ceil(log2 P) alpha + beta * received          (Bruck)
  allreduce        the cheaper of ring, 2(P-1) alpha + beta * 2b(P-1)/P, and recursive
                   doubling, ceil(log2 P) (alpha + beta b), as MPI libraries choose; a network
                   with allreduce='ring' (gloo's choice) always takes the ring
  broadcast        ceil(log2 P) alpha + beta * b                 (scatter + all-gather)
An algorithm's time is the sum over the ops of its slowest rank: ranks move in lock step, and
the model ignores waiting for a peer that is still computing.

A measured network can carry its own alpha and beta per op kind (`Network.per_kind`), fitted by
`fit_kind` to probes shaped like that op (`probe_op`; benchmarks.comm times them at the run's
P): one pair for every kind cannot describe a tbf-shaped link, on which a ring all-reduce
streams at about twice the rate of a pairwise exchange. A token-bucket shaped link (tc tbf, as
testbed.netem emulates, and the egress shaping of many cloud VMs) also has a `burst`, its
bucket, one for each direction (the emulated links shape both): bytes in a bucket cross at line
rate and cost nothing beyond alpha, the others pay beta. The buckets are full before a rank's
first op; each op empties the sending one by the bytes it sends and the receiving one by those
it receives, and they refill at the link's rate (1/beta) only while an op waits out its
latency, so a chain of small messages, each within the bucket alone, pays beta for most of
its bytes, and a rank that only receives (gTop-k's fold) leaves its sending bucket full.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from spardl_grace.communicators.collectives import RADIX_BITS
from spardl_grace.communicators.schedules import bruck_rounds, srs_schedule
from spardl_grace.selection import count_for_ratio
from spardl_grace import compact
from spardl_grace.compact import VALUE_BYTES, index_width
from spardl_grace.payload import frame_overhead
from spardl_grace.registry import SPARSE_ALLREDUCES

# Every communicator of the registry but GRACE's and Gaussian-k (TopkA's traffic with another
# selection; its messages vary in size, so no formula gives them).
ALGORITHMS = ("dense", *(a for a in SPARSE_ALLREDUCES if a != "gaussiank"))
KINDS = ("p2p", "alltoall", "allgather", "allreduce", "broadcast")
FP32 = 4
ENTRY = 8  # an int32 index and a float32 value (the exact wire)
#: the sparse all-reduces on the compact wire, by name ('spardl_compact')
COMPACT = tuple(f"{a}_compact" for a in ALGORITHMS if a != "dense")
RADIX_ROUNDS = 32 // RADIX_BITS  # digits of a float32 magnitude in Ok-Topk's radix select


@dataclass(frozen=True)
class Op:
    """One communication operation of one rank. `parts` lists (peer, sent, received) for
    point-to-point and all-to-all ops; collectives carry totals only."""
    kind: str                  # 'p2p', 'alltoall', 'allgather', 'allreduce' or 'broadcast'
    sent: int
    received: int
    parts: tuple[tuple[int, int, int], ...] = ()
    size: int = 0              # bytes of the collective's tensor (allreduce, broadcast)
    weight: float = 1.0        # how often per step (< 1: amortised, e.g. every 32nd step)


@dataclass(frozen=True)
class Network:
    """alpha (s per message) and beta (s per byte) between nodes; with ranks_per_node > 1,
    ranks r and s share a node when r // ranks_per_node == s // ranks_per_node and talk with
    alpha_intra and beta_intra. Collectives spanning nodes use the inter-node parameters.
    per_kind: (alpha, beta) of the op kinds (KINDS) that differ from the link's, between
    nodes. allreduce: 'best' (the cheaper of ring and recursive doubling, as MPI chooses) or
    'ring' (as gloo runs it). burst: the bucket of a token-bucket shaper on links between
    nodes, in bytes, refilled at 1/beta bytes a second (the module docstring); 0 for a
    plain link."""
    alpha: float
    beta: float
    ranks_per_node: int = 1
    alpha_intra: float = 0.0
    beta_intra: float = 0.0
    per_kind: dict[str, tuple[float, float]] = field(default_factory=dict)
    allreduce: str = "best"
    burst: float = 0.0

    @classmethod
    def from_bandwidth(cls, gbit_per_s: float, alpha: float, **hierarchy: float) -> "Network":
        return cls(alpha=alpha, beta=8.0 / (gbit_per_s * 1e9), **hierarchy)

    def params(self, kind: str) -> tuple[float, float]:
        """(alpha, beta) of an op of `kind` between nodes."""
        return self.per_kind.get(kind, (self.alpha, self.beta))

    def link(self, rank: int, peer: int, kind: str = "p2p") -> tuple[float, float, float]:
        """(alpha, beta, burst) between two ranks for an op of `kind`."""
        if self.ranks_per_node > 1 and rank // self.ranks_per_node == peer // self.ranks_per_node:
            return self.alpha_intra, self.beta_intra, 0.0
        return (*self.params(kind), self.burst)


@dataclass
class Calibration:
    """The data-dependent quantities of the schedules, measured on real traces (see `calibrate`).

    topkdsa_density: the density of one worker's top-k inside a region as seen by the union
      over workers, i.e. a region's reduced non-zeros are R (1 - (1 - x)^P); k/n when the
      workers' supports are independent, smaller when they overlap (real gradients).
    oktopk_local, oktopk_global: entries Ok-Topk's thresholds select, as a multiple of k
      (locally per worker and globally).
    oktopk_recompute: the fraction of steps in which Ok-Topk recomputes its global threshold
      (a radix select: RADIX_ROUNDS all-reduces); 1/threshold_interval at best.
    oktopk_region_interval: steps between two recomputations of Ok-Topk's regions.
    spardl_h: SparDL's cross-team h as a fraction of k_b, per number of teams d (1/d when
      the teams' pieces do not overlap).
    spardl_final: entries of a final SparDL block as a fraction of k_b (1 when the union of the
      teams' pieces is full)."""
    topkdsa_density: float | None = None
    oktopk_local: float = 1.0
    oktopk_global: float = 1.0
    spardl_h: dict[int, float] = field(default_factory=dict)
    spardl_final: float = 1.0
    oktopk_recompute: float = 1 / 32
    oktopk_region_interval: int = 64


# --------------------------------------------------------------------------- cost formulas
def spardl_layout(n: int, size: int, density: float, teams: int = 1) -> tuple[int, int, int]:
    """(m, B, k_b): workers per team, block length and per-block budget of SparDL."""
    m = size // teams
    block = math.ceil(n / m)
    return m, block, max(1, math.floor(block * density))


def variant(name: str) -> tuple[str, str]:
    """(algorithm, wire) of a name of ALGORITHMS or COMPACT: 'spardl_compact' is SparDL on the
    compact wire; ValueError naming the valid choices otherwise."""
    if name in ALGORITHMS:
        return name, "exact"
    if name in COMPACT:
        return name[: -len("_compact")], "compact"
    raise ValueError(f"unknown algorithm {name!r}; valid choices: {', '.join(ALGORITHMS + COMPACT)}")


def entry_bytes(block: int, wire: str) -> float:
    """Bytes per entry of a message of a block of `block` entries: 8 on the exact wire, 2 and
    ceil(log2 block) bits on the compact one (a message rounds its index bits up to a byte)."""
    return ENTRY if wire == "exact" else VALUE_BYTES + index_width(block) / 8


def message_bytes(count: int, block: int, wire: str) -> int:
    """Bytes of a message of `count` entries of a block of `block` entries, as the
    implementation sends it: 8 an entry on the exact wire; on the compact one 2 an entry and
    the indices packed at index_width(block) bits, rounded up to a whole byte."""
    return ENTRY * count if wire == "exact" else compact.message_bytes(count, block)


def formula_bytes(algorithm: str, n: int, size: int, density: float, teams: int = 1,
                  h: float | None = None) -> float:
    """Bytes one rank sends per step by the algorithm's cost formula (payload only), in 8-byte
    entries (2 words) on the exact wire and entry_bytes() on the compact one ('_compact'):
      dense    ring all-reduce, 2n(P-1)/P words
      topka    2k words to each of the P-1 others
      topkdsa  the lower bound with independent supports: 2k(P-1)/P words of reduce-scatter,
               then each region's union of the P workers' entries, sparse or dense
      gtopk    2k words per butterfly round (log2 p), plus the fold and final exchange of
               the P - p extra ranks (the busiest rank sends 2k log2 p + 2k + k/8 bits' worth)
      oktopk   4k(P-1)/P words with balanced regions and thresholds selecting k
      spardl   4k(P-d)/P + 2h(d-1) words with k = k_b P/d (h = k_b/d when not given)
    """
    algorithm, wire = variant(algorithm)
    if size == 1:
        return 0.0
    k = count_for_ratio(n, density)
    region = math.ceil(n / size)
    if algorithm == "dense":
        return FP32 * 2 * n * (size - 1) / size
    if algorithm == "topka":
        return entry_bytes(n, wire) * k * (size - 1)
    if algorithm == "topkdsa":
        union = region * (1 - (1 - k / n) ** size)
        entry = entry_bytes(region, wire)
        return entry * k * (size - 1) / size + (size - 1) * min(entry * union, FP32 * region)
    if algorithm == "gtopk":
        p = 1 << (size.bit_length() - 1)
        entry = entry_bytes(n, wire)
        final = entry * k + math.ceil(k / 8) if size > p else 0
        return entry * k * (p.bit_length() - 1) + final
    if algorithm == "oktopk":
        return 2 * entry_bytes(region, wire) * k * (size - 1) / size
    m, block, kb = spardl_layout(n, size, density, teams)
    k = kb * m
    h = kb / teams if h is None else h
    return entry_bytes(block, wire) * (2 * k * (size - teams) / size + h * (teams - 1))


# --------------------------------------------------------------------------- traces
def ops_from_messages(messages: Iterable, size: int) -> list[Op]:
    """A rank's CountingTransport messages, in order, as Ops: the send and receive of one
    sendrecv form a p2p op, the per-peer records of one all-to-all one alltoall op."""
    ops: list[Op] = []
    pending: dict[str, list] = {}
    last_alltoall: str | None = None
    for m in messages:
        if m.op == "alltoall":
            if last_alltoall == m.name:
                prev = ops.pop()
                parts = prev.parts + ((m.peer, m.bytes_sent, m.bytes_received),)
            else:
                parts = ((m.peer, m.bytes_sent, m.bytes_received),)
            ops.append(Op("alltoall", sum(p[1] for p in parts), sum(p[2] for p in parts), parts))
            last_alltoall = m.name
            continue
        last_alltoall = None
        if m.op in ("send", "recv"):
            half = pending.pop(m.name, None)
            if half is None:
                pending[m.name] = [m]
                continue
            send, recv = (half[0], m) if half[0].op == "send" else (m, half[0])
            parts = ((send.peer, send.bytes_sent, 0), (recv.peer, 0, recv.bytes_received))
            ops.append(Op("p2p", send.bytes_sent, recv.bytes_received, parts))
        elif m.op == "allgather":
            ops.append(Op("allgather", m.bytes_sent, m.bytes_received))
        elif m.op == "allreduce":
            ops.append(Op("allreduce", m.bytes_sent, m.bytes_received,
                          size=_allreduce_tensor_bytes(m.bytes_sent, size)))
        elif m.op == "broadcast":
            nbytes = m.bytes_received or m.bytes_sent // max(size - 1, 1)
            ops.append(Op("broadcast", m.bytes_sent, m.bytes_received, size=nbytes))
    return [op for op in ops if not _self_exchange(op)]


def _self_exchange(op: Op) -> bool:
    return op.kind == "p2p" and op.sent == 0 and op.received == 0


def _allreduce_tensor_bytes(volume: int, size: int) -> int:
    return volume * size // (2 * (size - 1)) if size > 1 else 0


# --------------------------------------------------------------------------- prediction
def op_seconds(op: Op, rank: int, size: int, net: Network, tokens: float | None = None) -> float:
    """The time of one op of `rank` under `net` (see the module docstring), with `tokens` bytes
    in each of the shaper's buckets, sending and receiving, as it starts (full ones, net.burst,
    when not given)."""
    full = net.burst if tokens is None else tokens
    return _op_cost(op, rank, size, net, (full, full))[0]


Buckets = tuple[float, float]  # bytes in the shaper's sending and receiving buckets


def _op_cost(op: Op, rank: int, size: int, net: Network, tokens: Buckets) -> tuple[float, Buckets]:
    """(seconds, the buckets after it) of one op that starts with `tokens` in the shaper's
    sending and receiving buckets. A rank's link is shaped both ways (testbed.netem), each
    way with its own bucket: the bytes it sends draw on one, those it receives on the other.
    The buckets refill while the op waits out its latency; then the bytes in them cross at line
    rate and the rest pay beta, the slower direction setting the time."""
    if op.kind in ("p2p", "alltoall"):
        classes: dict[tuple[float, float, float], list] = {}
        for peer, sent, received in op.parts:
            if peer == rank or peer < 0:
                continue
            entry = classes.setdefault(net.link(rank, peer, op.kind), [0, 0, set()])
            entry[0] += sent
            entry[1] += received
            entry[2].add(peer)
        costs = [_shaped(a * (1 if op.kind == "p2p" else len(peers)), b, (s, r), burst, tokens,
                         net.beta)
                 for (a, b, burst), (s, r, peers) in classes.items()]
        if not costs:
            return 0.0, tokens
        # The slowest class of links sets the time; the one between nodes drains the buckets.
        return (max(c[0] for c in costs),
                (min(c[1][0] for c in costs), min(c[1][1] for c in costs)))
    spans_nodes = size > net.ranks_per_node
    alpha, beta = net.params(op.kind) if spans_nodes else (net.alpha_intra, net.beta_intra)
    burst = net.burst if spans_nodes else 0.0
    rounds = math.ceil(math.log2(size)) if size > 1 else 0
    if op.kind == "allgather":
        shapes = [(rounds * alpha, op.received)]
    elif op.kind == "allreduce":
        shapes = [(2 * (size - 1) * alpha, 2 * op.size * (size - 1) / size)]
        if net.allreduce != "ring":
            shapes.append((rounds * alpha, rounds * op.size))
    elif op.kind == "broadcast":
        shapes = [(rounds * alpha, op.size)]
    else:
        raise ValueError(f"unknown op kind {op.kind!r}")
    # A collective's volume crosses the link both ways.
    return min((_shaped(latency, beta, (volume, volume), burst, tokens, net.beta)
                for latency, volume in shapes), key=lambda c: c[0])


def _shaped(latency: float, beta: float, volume: tuple[float, float], burst: float,
            tokens: Buckets, line_beta: float) -> tuple[float, Buckets]:
    """(seconds, the buckets after) of volume = (bytes sent, bytes received) after `latency` on
    a link whose two buckets of `burst` bytes hold `tokens` and refill at 1/line_beta bytes a
    second (at once when line_beta is 0). A link without a bucket (burst 0) leaves `tokens` as
    they were."""
    if not burst:
        return latency + beta * max(volume), tokens
    free = [min(burst, t + latency / line_beta) if line_beta > 0 else burst for t in tokens]
    beyond = max(max(0.0, v - f) for v, f in zip(volume, free))
    return latency + beta * beyond, (max(0.0, free[0] - volume[0]), max(0.0, free[1] - volume[1]))


def predict_seconds(ops: Sequence[Op], rank: int, size: int, net: Network) -> float:
    """Communication seconds of one rank's ops, one after the other. The shaper's buckets
    (net.burst, one each way) are full before the first op; each op draws the bytes it sends
    and receives from them, and they refill only while an op waits out its latency, as in a
    step's communication replayed with nothing between the ops."""
    seconds, tokens = 0.0, (float(net.burst), float(net.burst))
    for op in ops:
        took, left = _op_cost(op, rank, size, net, tokens)
        seconds += op.weight * took
        # an op run every 1/weight steps, on average
        tokens = (tokens[0] + op.weight * (left[0] - tokens[0]),
                  tokens[1] + op.weight * (left[1] - tokens[1]))
    return seconds


# --------------------------------------------------------------------------- probes
PROBE_CHAIN = 4  # collectives per probe, back to back
FIT_ROUNDS = 100  # at most; each fit takes the bucket's refill from the last one's alpha


def probe_chain(kind: str, size: int) -> int:
    """How many ops of `kind` a probe runs back to back at P = size (benchmarks.comm times
    the chain and divides): P - 1 exchanges, one with each distance, or PROBE_CHAIN
    collectives."""
    return size - 1 if kind == "p2p" else PROBE_CHAIN


def probe_op(kind: str, nbytes: int, size: int, rank: int = 0) -> Op:
    """The op that benchmarks.comm times to fit `kind`'s alpha and beta at P = size, with
    `nbytes` in the model's measure of that kind: one exchange of nbytes each way with two
    peers (p2p; benchmarks.comm times a chain of them), the bytes a rank receives
    (allgather), sends to all others (alltoall), or the tensor's bytes (allreduce,
    broadcast). Pieces are whole float32 entries."""
    if size < 2:
        raise ValueError("probes need at least 2 ranks")
    piece = FP32 * max(1, nbytes // (FP32 * (size - 1)))
    whole = FP32 * max(1, nbytes // FP32)
    if kind == "p2p":
        return _p2p(rank, (rank + 1) % size, (rank - 1) % size, whole, whole)
    if kind == "allgather":
        return Op("allgather", piece * (size - 1), piece * (size - 1))
    if kind == "alltoall":
        return Op("alltoall", piece * (size - 1), piece * (size - 1),
                  tuple((p, piece, piece) for p in range(size) if p != rank))
    if kind == "allreduce":
        return _allreduce(whole, size)
    if kind == "broadcast":
        return Op("broadcast", whole * (size - 1) if rank == 0 else 0,
                  0 if rank == 0 else whole, size=whole)
    raise ValueError(f"unknown op kind {kind!r}; valid choices: {', '.join(KINDS)}")


def fit_kind(samples: Sequence[tuple[Op, int, float]], burst: float = 0.0,
             line_beta: float = 0.0) -> tuple[float, float]:
    """(alpha, beta) of one op kind on a flat network with this `burst` (refilled at
    1/line_beta bytes per second while the link waits), from (op, P, measured seconds) probes,
    each a chain of probe_chain ops: the non-negative pair that minimises the squared relative
    error of the prediction (small and large probes weigh alike; all-reduces as rings, as gloo
    runs them). The refill depends on alpha, so the fit is repeated with the last alpha until
    alpha settles."""
    alpha, beta = _fit_rows(_probe_rows(samples, burst, line_beta, 0.0))
    for _ in range(FIT_ROUNDS):
        last = alpha
        alpha, beta = _fit_rows(_probe_rows(samples, burst, line_beta, alpha))
        if abs(alpha - last) <= 1e-9 * alpha:
            break
    return alpha, beta


def _probe_rows(samples: Sequence[tuple[Op, int, float]], burst: float, line_beta: float,
                alpha: float) -> list[tuple[float, float]]:
    """Per probe, its seconds' multiples of alpha and of beta (the coefficients fit_kind's
    least squares solves for), with the bucket refilled during latencies of `alpha`."""
    rows = []
    for op, size, seconds in samples:
        chain = [op] * probe_chain(op.kind, size)
        units = predict_seconds(chain, 0, size, Network(1.0, 0.0, allreduce="ring")) / len(chain)
        net = Network(alpha, line_beta, per_kind={op.kind: (alpha, 1.0)}, allreduce="ring",
                      burst=burst)
        beyond = predict_seconds(chain, 0, size, net) / len(chain) - units * alpha
        rows.append((units / seconds, beyond / seconds))
    return rows


def _fit_rows(rows: list[tuple[float, float]]) -> tuple[float, float]:
    sxx = sum(x * x for x, _ in rows)
    syy = sum(y * y for _, y in rows)
    sxy = sum(x * y for x, y in rows)
    sx, sy = sum(x for x, _ in rows), sum(y for _, y in rows)
    det = sxx * syy - sxy * sxy
    if det > 0:
        alpha, beta = (sx * syy - sy * sxy) / det, (sy * sxx - sx * sxy) / det
        if alpha >= 0 and beta >= 0:
            return alpha, beta
    # The best fit needs a negative parameter: the best with one of them zero instead.
    fits = [(sx / sxx if sxx else 0.0, 0.0), (0.0, sy / syy if syy else 0.0)]
    return min(fits, key=lambda ab: sum((x * ab[0] + y * ab[1] - 1) ** 2 for x, y in rows))


# --------------------------------------------------------------------------- schedules
def _p2p(rank: int, dst: int, src: int, sent: int, received: int) -> Op:
    return Op("p2p", sent, received, ((dst, sent, 0), (src, 0, received)))


def _allreduce(nbytes: int, size: int, weight: float = 1.0) -> Op:
    volume = 2 * nbytes * (size - 1) // size
    return Op("allreduce", volume, volume, size=nbytes, weight=weight)


def _bruck(rank_in_group: int, group: Sequence[int], piece: int) -> list[Op]:
    """Bruck all-gather of one `piece`-byte message per member (pieces framed together)."""
    g = len(group)
    ops = []
    for distance, count in bruck_rounds(g):
        nbytes = piece * count + frame_overhead(count)
        ops.append(_p2p(group[rank_in_group], group[(rank_in_group - distance) % g],
                        group[(rank_in_group + distance) % g], nbytes, nbytes))
    return ops


def synthesize(algorithm: str, n: int, size: int, density: float, teams: int = 1,
               calibration: Calibration | None = None, rank: int = 0) -> list[Op]:
    """The ops `rank` performs in one step of `algorithm` on n fp32 entries with P = size,
    generated from the schedule (no data): each message's bytes are those the implementation
    sends, with the data-dependent counts taken from `calibration`. Rank 0 is the busiest
    rank of every algorithm here (gtopk's final exchange included). A '_compact' name sends
    entry_bytes() of its block an entry."""
    algorithm, wire = variant(algorithm)
    cal = calibration or Calibration()
    if size == 1:
        return []
    k = count_for_ratio(n, density)
    others = [p for p in range(size) if p != rank]
    region = math.ceil(n / size)
    if algorithm == "dense":
        volume = FP32 * 2 * n * (size - 1) // size
        return [Op("allreduce", volume, volume, size=FP32 * n)]
    if algorithm == "topka":
        piece = message_bytes(k, n, wire)
        return [Op("allgather", piece * (size - 1), piece * (size - 1))]
    if algorithm == "topkdsa":
        x = k / n if cal.topkdsa_density is None else cal.topkdsa_density
        entry = entry_bytes(region, wire)
        per_peer = round(entry * k / size)
        reduce = Op("alltoall", per_peer * (size - 1), per_peer * (size - 1),
                    tuple((p, per_peer, per_peer) for p in others))
        piece = min(round(entry * round(region * (1 - (1 - x) ** size))), FP32 * region)
        return [reduce, Op("allgather", piece * (size - 1), piece * (size - 1))]
    if algorithm == "gtopk":
        p = 1 << (size.bit_length() - 1)
        extra = size - p
        msg = message_bytes(k, n, wire)
        final = msg + math.ceil(k / 8) + frame_overhead(2)
        if rank >= p:  # an extra rank: folds its entries into rank - p, receives the result
            return [_p2p(rank, rank - p, rank - p, msg, 0), _p2p(rank, rank - p, rank - p, 0, final)]
        ops = [_p2p(rank, p + rank, p + rank, 0, msg)] if rank < extra else []
        ops += [_p2p(rank, rank ^ (1 << i), rank ^ (1 << i), msg, msg)
                for i in range(p.bit_length() - 1)]
        if rank < extra:
            ops.append(_p2p(rank, p + rank, p + rank, final, 0))
        return ops
    if algorithm == "oktopk":
        entry = entry_bytes(region, wire)
        per_peer = round(entry * cal.oktopk_local * k / size)
        reduce = Op("alltoall", per_peer * (size - 1), per_peer * (size - 1),
                    tuple((p, per_peer, per_peer) for p in others))
        piece = round(entry * cal.oktopk_global * k / size)
        ops = [reduce, _allreduce(8, size, 1 - cal.oktopk_recompute)]  # the count check
        radix = [_allreduce(8, size, cal.oktopk_recompute)]
        radix += [_allreduce(8 << RADIX_BITS, size, cal.oktopk_recompute)] * RADIX_ROUNDS
        regions = _allreduce(8 * (size - 1), size, 1 / cal.oktopk_region_interval)
        return ops + radix + [regions, Op("allgather", piece * (size - 1), piece * (size - 1))]
    return _spardl_ops(n, size, density, teams, cal, rank, wire)


def _spardl_ops(n: int, size: int, density: float, teams: int, cal: Calibration,
                rank: int, wire: str) -> list[Op]:
    if size % teams:
        raise ValueError(f"teams (d={teams}) must divide the number of workers ({size})")
    m, block, kb = spardl_layout(n, size, density, teams)
    team, q = divmod(rank, m)
    team_ranks = [team * m + j for j in range(m)]
    ops = []
    piece = message_bytes(kb, block, wire)
    for rnd in srs_schedule(m):
        dst, src = team_ranks[(q + rnd.distance) % m], team_ranks[(q - rnd.distance) % m]
        ops += [_p2p(rank, dst, src, piece, piece)] * rnd.blocks
    if teams > 1:
        h = max(math.ceil(kb / teams), round(kb * cal.spardl_h.get(teams, 1 / teams)))
        group = [t * m + q for t in range(teams)]
        ops += _bruck(team, group, message_bytes(min(h, kb), block, wire))
    final = max(1, round(kb * cal.spardl_final))
    ops += _bruck(q, team_ranks, message_bytes(final, block, wire))
    return ops


# --------------------------------------------------------------------------- calibration
def calibrate(records: dict[str, list[dict]], n: int, density: float) -> Calibration:
    """Calibration from measured step statistics: records[algorithm] is a list of
    {'size': P, 'teams': d, 'stats': grc.last_stats} for the steps measured; an algorithm on the
    compact wire ('spardl_compact') calibrates its algorithm like the exact one."""
    cal = Calibration()
    k = count_for_ratio(n, density)
    by_base: dict[str, list[tuple[str, dict]]] = {}
    for name, runs in records.items():
        base, wire = variant(name)
        by_base.setdefault(base, []).extend((wire, r) for r in runs if r["size"] > 1)
    dsa = [r for _, r in by_base.get("topkdsa", [])]
    if dsa:
        xs = []
        for r in dsa:
            size = r["size"]
            region = math.ceil(n / size)
            nnz = min(r["stats"]["gather_entries"], region - 1)
            xs.append(1 - (1 - nnz / region) ** (1 / size))
        cal.topkdsa_density = sum(xs) / len(xs)
    ok = [r for _, r in by_base.get("oktopk", [])]
    if ok:
        # A recomputation runs the radix select's all-reduces; a reused threshold only the count.
        cal.oktopk_recompute = sum(r["stats"]["threshold_payload_bytes"] > 2 * 8 for r in ok) / len(ok)
        cal.oktopk_local = sum(r["stats"]["reduce_entries"] * r["size"] / ((r["size"] - 1) * k)
                               for r in ok) / len(ok)
        cal.oktopk_global = sum(r["stats"]["gather_entries"] * r["size"] / k for r in ok) / len(ok)
    by_teams: dict[int, list[float]] = {}
    finals = []
    for wire, r in by_base.get("spardl", []):
        size, d = r["size"], r.get("teams", 1)
        m, block, kb = spardl_layout(n, size, density, d)
        if d > 1:
            by_teams.setdefault(d, []).append(r["stats"]["cross_entries"] / kb)
        if m > 1:
            finals.append(r["stats"]["sag_payload_bytes"]
                          / (message_bytes(kb, block, wire) * (m - 1)))
    cal.spardl_h = {d: sum(v) / len(v) for d, v in by_teams.items()}
    if finals:
        cal.spardl_final = sum(finals) / len(finals)
    return cal
