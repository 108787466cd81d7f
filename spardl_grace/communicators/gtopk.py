"""'gtopk': gTop-k (Shi et al., ICDCS 2019), a global top-k by recursive-doubling merges, for
any number of workers.

Every worker selects its exact local top-k of |A| (k = floor(rho*n)). With p = 2^floor(log2 P):
0. Fold (P not a power of two): rank p+e sends its set to rank e, which merges it.
1. log2 p butterfly rounds among ranks 0..p-1: in round i, partners r and r xor 2^i exchange
   their current sets (k entries, int32 indices into the whole tensor) and both merge them:
   values on common indices are summed, and the top-k of the union (at most 2k) is kept. Both
   partners merge in the same order, so after the last round all p hold identical bits.
2. Final: the set is coded once more (identically on every rank), rank e sends it to rank
   p+e, and every worker applies values / P.
Cost per worker (p = P): log2 P latency terms and 2k log2 P words; otherwise two more
messages for the folded pairs (the reference code instead reduces to rank 0 and broadcasts,
about twice this, and fails unless P is a power of two).

Residual rule ('exact', the default). A merge can drop a contribution at an intermediate
round and select the same index later through another branch; the paper's rule (a worker
keeps its selected values whose index is not in the final set) then loses that contribution.
Here every worker tracks, for each entry of its current set, how much of the entry's value it
contributed (its *credit*); entries dropped by a merge take their credits with them. The new
residual is A minus the credit of the entries in the final set, so
    sum_w A_w == P * result + sum_w residual_w
holds exactly (up to float rounding) for every P. A lossy codec's error on a group's set is
credited to the group's lowest rank, which keeps conservation with codecs too. rho = 1 gives
the dense average.

'paper' reproduces the original rule: residual = A with (locally selected AND finally
selected) indices zeroed. It does not conserve mass when a contribution was dropped mid-way
for an index that is finally selected; it exists to compare against the published algorithm.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..api import Memory
from ..payload import PayloadCodec, frame_overhead, pack_frames, unpack_frames
from ..selection import count_for_ratio, topk_abs, topk_abs_lowest_ties
from ..transport import Transport
from ..utils import bitpack
from ._base import CodedAllreduce
from .collectives import realign
from .exchange import Exchange

RESIDUAL_RULES = ("exact", "paper")


class _Set(NamedTuple):
    """A worker's current candidate set: sorted unique indices, values, this worker's credit,
    and (on a fold partner) which entries still carry the folded worker's contribution."""

    indices: torch.Tensor
    values: torch.Tensor
    credit: torch.Tensor
    folded: torch.Tensor | None


def _sorted(indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.argsort(indices)
    return indices[order], values[order]


class GTopk(CodedAllreduce):
    """The 'gtopk' communicator. residual_rule: 'exact' (conserves mass, default) or 'paper'."""

    PHASES = ("fold", "merge", "final")

    def __init__(
        self,
        memory: Memory,
        transport: Transport,
        density: float,
        residual_rule: str = "exact",
        codec: PayloadCodec | None = None,
    ):
        super().__init__(memory, transport, density, codec)
        if residual_rule not in RESIDUAL_RULES:
            raise ValueError(
                f"unknown gtopk residual rule {residual_rule!r}; valid choices: "
                f"{', '.join(RESIDUAL_RULES)}"
            )
        self.residual_rule = residual_rule
        size = transport.size
        self.butterfly = 1 << (size.bit_length() - 1)  # p: the largest power of two <= P
        self.extra = size - self.butterfly

    def sparse_allreduce(
        self, tensor: torch.Tensor, name: str, step: int, ex: Exchange
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, me = tensor.numel(), ex.rank
        k = count_for_ratio(n, self.density_at(step, n))
        with ex.selecting():
            chosen = torch.sort(topk_abs(tensor, k, self.scratch)).values
        own = ex.encode(tensor, chosen, f"select.{me}")
        own_idx, own_vals = _sorted(own.indices, own.values)
        current = _Set(own_idx, own_vals, own_vals.clone(), None)

        with ex.phase("fold"):
            current = self._fold(ex, current, own.data, n, k)
        final = None
        with ex.phase("merge"):
            for i in range(self.butterfly.bit_length() - 1):
                if me < self.butterfly:
                    current = self._merge_round(ex, current, i, n, k)
                else:  # folded ranks wait, but still enter every op (Horovod needs all ranks)
                    _send_to(ex, None, None, i)
        with ex.phase("final"):
            if me < self.butterfly:
                final = self._final_coding(ex, current, n)
            final_idx, final_vals, credit = self._deliver(ex, final, own_idx, own_vals, n, k)

        result = self.zeros_for_result(name, tensor)
        result.index_copy_(0, final_idx, final_vals / ex.size)
        self.record_support(name, result, final_idx)
        residual = self.working_copy(tensor, name)
        if self.residual_rule == "exact":
            residual[final_idx] -= credit
        else:
            residual[chosen[torch.isin(chosen, final_idx)]] = 0
        return result, residual

    def _set_size(self, k: int, dtype: torch.dtype, n: int) -> int | None:
        """Bytes of a coded set of k entries of the whole tensor (n entries), when the codec
        fixes it (every set sent holds exactly k entries: the top k of a union of two
        k-sets)."""
        return self.codec.fixed_size(k, dtype, n)

    def _fold(self, ex: Exchange, current: _Set, coded: torch.Tensor, n: int, k: int) -> _Set:
        if not self.extra:
            return current
        me, p = ex.rank, self.butterfly
        if me >= p:
            ex.stats.entries["fold"] = current.indices.numel()
            _send_to(ex, me - p, coded)
            return current
        if me < self.extra:
            got = _send_to(ex, me + p, None, expected=self._set_size(k, current.values.dtype, n))
            idx, vals = _sorted(*ex.decode(got, n, current.values, f"select.{me + p}"))
            ones = torch.ones(idx.numel(), dtype=torch.bool, device=idx.device)
            return self._merge(
                ex,
                current._replace(folded=torch.zeros_like(current.indices, dtype=torch.bool)),
                _Set(idx, vals, torch.zeros_like(vals), ones),
                k,
            )
        _send_to(ex, None, None)
        return current

    def _merge_round(self, ex: Exchange, current: _Set, i: int, n: int, k: int) -> _Set:
        me = ex.rank
        partner = me ^ (1 << i)
        leader, partner_leader = (me >> i) << i, (partner >> i) << i
        enc = ex.encode_sparse(current.indices, current.values, n, f"merge.{i}.{leader}")
        mine = self._after_coding(current, enc.indices, enc.values, leader == me)
        ex.stats.entries["merge"] += enc.indices.numel()
        got = _send_to(ex, partner, enc.data, i, self._set_size(k, current.values.dtype, n))
        idx, vals = _sorted(*ex.decode(got, n, current.values, f"merge.{i}.{partner_leader}"))
        theirs = _Set(
            idx,
            vals,
            torch.zeros_like(vals),
            None if current.folded is None else torch.zeros_like(idx, dtype=torch.bool),
        )
        low, high = (mine, theirs) if me < partner else (theirs, mine)
        return self._merge(ex, low, high, k)

    @staticmethod
    def _after_coding(
        current: _Set, idx: torch.Tensor, vals: torch.Tensor, is_leader: bool
    ) -> _Set:
        """Our set as the receiver decodes it; the leader's credit absorbs the coding error."""
        idx, vals = _sorted(idx, vals)
        credit = realign(current.indices, current.credit, idx)
        if is_leader:
            credit += vals - realign(current.indices, current.values, idx)
        folded = None
        if current.folded is not None:
            folded = realign(current.indices, current.folded.to(torch.uint8), idx).bool()
        return _Set(idx, vals, credit, folded)

    @staticmethod
    def _merge(ex: Exchange, low: _Set, high: _Set, k: int) -> _Set:
        """Sum two sets on common indices and keep the top-k of the union, ties at the k-th
        magnitude to the lowest indices. Identical on both partners (the same operands in the
        same order, low rank's side first) and on every device."""
        with ex.selecting():
            cat_idx = torch.cat([low.indices, high.indices])
            union, inverse = torch.unique(cat_idx, sorted=True, return_inverse=True)
            values = torch.zeros(union.numel(), dtype=low.values.dtype, device=union.device)
            values.index_add_(0, inverse, torch.cat([low.values, high.values]))
            credit = torch.zeros_like(values)
            credit.index_add_(0, inverse, torch.cat([low.credit, high.credit]))
            folded = None
            if low.folded is not None and high.folded is not None:
                flags = torch.cat([low.folded, high.folded]).to(torch.int32)
                folded = torch.zeros(union.numel(), dtype=torch.int32, device=union.device)
                folded = folded.index_add_(0, inverse, flags) > 0
            keep = topk_abs_lowest_ties(values, k)
        return _Set(
            union[keep], values[keep], credit[keep], None if folded is None else folded[keep]
        )

    def _final_coding(self, ex: Exchange, current: _Set, n: int) -> tuple:
        enc = ex.encode_sparse(current.indices, current.values, n, "final")
        final = self._after_coding(current, enc.indices, enc.values, ex.rank == 0)
        return final, enc.data

    def _deliver(
        self,
        ex: Exchange,
        final,
        own_idx: torch.Tensor,
        own_vals: torch.Tensor,
        n: int,
        k: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(final indices, final values, our credit on them) on every rank: the fold partners
        send the coded final set (k entries) and a bitmask of the entries that carry the folded
        worker's contribution, whose credit is then its own coded value there."""
        me, p = ex.rank, self.butterfly
        if not self.extra:
            final_set, _ = final
            return final_set.indices, final_set.values, final_set.credit
        if me < p:
            final_set, data = final
            if me < self.extra:
                message = pack_frames(
                    [data, bitpack.pack(final_set.folded.to(torch.int64), 1).to(data.device)]
                )
                ex.stats.entries["final"] = final_set.indices.numel()
                _send_to(ex, me + p, message)
            else:
                _send_to(ex, None, None)
            return final_set.indices, final_set.values, final_set.credit
        size = self._set_size(k, own_vals.dtype, n)
        if size is not None:  # the set and a bit per entry, framed
            size += bitpack.packed_size(k, 1) + frame_overhead(2)
        got = _send_to(ex, me - p, None, expected=size)
        data, mask = unpack_frames(got)
        idx, vals = _sorted(*ex.decode(data, n, own_vals, "final"))
        folded = bitpack.unpack(mask, idx.numel(), 1).to(device=idx.device, dtype=torch.bool)
        credit = torch.where(folded, realign(own_idx, own_vals, idx), torch.zeros_like(vals))
        return idx, vals, credit


def _send_to(
    ex: Exchange,
    peer: int | None,
    data: torch.Tensor | None,
    suffix: object = None,
    expected: int | None = 0,
) -> torch.Tensor:
    """One step of a pairwise exchange in which only some ranks take part: every rank calls
    sendrecv (Horovod needs all ranks in every op); idle ranks talk to themselves.
    expected: the bytes the peer sends (0 unless given; None: unknown, sizes travel)."""
    me = ex.rank
    out = data if data is not None else torch.empty(0, dtype=torch.uint8)
    peer = me if peer is None else peer
    if peer == me:
        expected = 0
    return ex.sendrecv(out, peer, peer, suffix, expected)
