"""SparDL (Zhao et al., arXiv 2304.00737): Spar-Reduce-Scatter, Global Residual Collection and
Spar-All-Gather with d teams.

Layout. The flat compensated gradient A (n entries; the integrations fuse all layers into one
buffer) is zero-padded to m*B with m = P/d workers per team and B = ceil(n/m), and viewed as m
blocks of B; in-team rank q owns block q. Per-block budget k_b = max(1, floor(B*rho)).
Team t holds ranks t*m .. t*m+m-1; the d ranks with the same in-team rank q (one per team)
form block q's cross-team group.

1. Spar-Reduce-Scatter (SRS) inside each team, any m: m-1 sequential messages per worker,
   each carrying exactly k_b entries (block-relative int32 indices) of one block, chosen as
   the top-k_b by magnitude of everything the worker holds for that block at that moment.
2. With d > 1, cross-team exchange: each block owner sends the top-h entries of its team sum
   through a Bruck all-gather in its group (ceil(log2 d) messages); every member sums the d
   pieces in team order (so all compute identical bits) and keeps the top-k_b of the union.
   h adapts between ceil(k_b/d) and k_b so that the union holds about k_b entries.
3. Spar-All-Gather: a Bruck all-gather inside the team gives every worker the final entries
   of every block; the result is their values / P.

Global Residual Collection. Each worker keeps A and its working copy D (per block: what it
held when it selected from the block, minus what it sent; for forwarded blocks this includes
partial sums received from others). With S_b the final selected set of block b, the new
residual is D at S_b and A elsewhere. Hence, for every P and d, exactly up to float rounding,
    sum_w A_w == P * result + sum_w residual_w,
and with rho = 1 the result is the dense average with zero residuals. Lossy payload codecs
keep the same promise: senders subtract what the receiver decodes, and the one difference
the cross-team stage can introduce is kept by the block owner of team 0.

Cost per worker (alpha-beta): (m - 1 + ceil(log2 d) + ceil(log2 m)) messages and about
4k(P-d)/P + 2h(d-1) words (k = rho*n): d = 1 minimises words, larger d trades words for
fewer sequential messages (latency).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..api import Memory
from ..payload import Encoded, PayloadCodec
from ..selection import topk_abs
from ..transport import Transport
from ._base import CodedAllreduce
from .exchange import Exchange, Undo
from .schedules import srs_schedule

H_GAIN = 0.5  # weight of the new estimate in the adaptive-h update (the rest is inertia)


def block_layout(numel: int, team_size: int, density: float) -> tuple[int, int]:
    """(B, k_b): SparDL's block length and per-block budget for a tensor of `numel` entries
    split among `team_size` workers at `density` (at least one entry a non-empty block)."""
    block = math.ceil(numel / team_size)
    return block, min(block, max(1, math.floor(block * density)))


class SparDL(CodedAllreduce):
    """The 'spardl' communicator. Use with memory 'global_residual' (or 'none' to drop residuals).

    density: rho in (0, 1]; teams: d, a divisor of the number of workers (1 disables the
    cross-team stage, P makes SparDL an all-gather of per-block top-k); codec: how sparse
    messages are coded (identity by default; DeepReduce codecs plug in here)."""

    RANK_LOCAL = ("team", "q")
    PHASES = ("srs", "cross", "sag")

    def __init__(
        self,
        memory: Memory,
        transport: Transport,
        density: float,
        teams: int = 1,
        codec: PayloadCodec | None = None,
    ):
        super().__init__(memory, transport, density, codec)
        if not isinstance(teams, int) or teams < 1 or transport.size % teams:
            divisors = [d for d in range(1, transport.size + 1) if transport.size % d == 0]
            raise ValueError(
                f"teams must divide the number of workers ({transport.size}): "
                f"choose one of {divisors}, got {teams!r}"
            )
        self.teams = teams
        self.team_size = transport.size // teams
        self.team, self.q = divmod(transport.rank, self.team_size)
        self._h: dict[str, int] = {}

    def block_layout(self, numel: int, density: float | None = None) -> tuple[int, int]:
        """(B, k_b): block length and per-block budget for a tensor of `numel` entries at
        `density` (the steady-state density if None)."""
        return block_layout(numel, self.team_size, self.density if density is None else density)

    def h_for(self, name: str, numel: int, density: float | None = None) -> int:
        """Entries each block owner contributes to the cross-team exchange for `name` at
        `density` (the steady-state density if None): the adapted h, within ceil(k_b/d)..k_b
        of that density (a warm-up stage's end shrinks k_b under an h adapted before)."""
        block, kb = self.block_layout(numel, density)
        if kb >= block:
            return block
        low = math.ceil(kb / self.teams)
        return min(kb, max(low, self._h.get(name, low)))

    def working_numel(self, numel: int) -> int:
        return self.team_size * self.block_layout(numel)[0]

    def sparse_allreduce(
        self, tensor: torch.Tensor, name: str, step: int, ex: Exchange
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = tensor.numel()
        density = self.density_at(step, n)
        block, kb = self.block_layout(n, density)
        m = self.team_size
        working = self.working_copy(tensor, name)  # D, starting as A
        blocks = working.view(m, block)
        team_ranks = [self.team * m + j for j in range(m)]
        undo: Undo = []  # every write into D, with what it overwrote

        with ex.phase("srs"):
            self._spar_reduce_scatter(ex, blocks, kb, team_ranks, undo)
        final = self._select_final(ex, blocks[self.q], name, n, density, undo)
        # With one team every final piece is exactly k_b entries; with cross-team merging it
        # is at most k_b, so its size travels with it.
        piece_size = self.codec.fixed_size(kb, tensor.dtype, block) if self.teams == 1 else None
        with ex.phase("sag"):
            pieces = ex.bruck_allgather(final.data, team_ranks, self.q, piece_size)

        result = self.zeros_for_result(name, working)
        selected = []
        for j, data in enumerate(pieces):
            # Our own piece decodes to what its encoding reported: no need to decode it.
            idx, vals = (
                (final.indices, final.values)
                if j == self.q
                else ex.decode(data, block, tensor, f"final.{j}")
            )
            positions = j * block + idx
            result.index_copy_(0, positions, vals / ex.size)  # zeros need no division
            selected.append(positions)
        support = torch.cat(selected)
        # What lands in the padding is never returned, so it need not be zeroed again.
        self.record_support(name, result, support[support < n])
        residual = self._residual(working, n, support, undo)
        return result[:n], residual

    def reduce_scatter(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Spar-Reduce-Scatter alone, as a reduce-scatter (FSDP's, spardl_grace.fsdp.flat_shard):
        compensate the flat `tensor` (its numel a multiple of the number of workers, as FSDP
        pads it), run SRS, and return this rank's block (block `rank`, tensor.numel() / P
        entries) of the SUM over the ranks: its own compensated entries of that block, dense,
        plus the sparse partial sums the others sent. The residual kept for `name` is what
        this rank did not send of the other blocks (zero in its own block), so
            sum_w compensated_w == concat_w(block_w) + sum_w residual_w
        up to float rounding, and at density 1 the blocks are the dense sum's. One team only
        (`teams` 1): the cross-team stage and the all-gather have no place in a reduce-scatter."""
        if self.teams != 1:
            raise ValueError(
                f"SparDL as a reduce-scatter runs in one team (teams=1), got teams={self.teams}"
            )
        n, m = tensor.numel(), self.team_size
        if n == 0 or n % m:
            raise ValueError(
                f"a reduce-scatter over {m} workers needs a non-empty tensor whose numel is a "
                f"multiple of {m} (FSDP pads its input so), got {n} entries for '{name}'"
            )
        compensated = self.agreed_compensation(tensor, name)
        step, ex = self.new_exchange(name)
        working = self.working_copy(compensated.reshape(-1), name)
        blocks = working.view(m, n // m)
        kb = self.block_layout(n, self.density_at(step, n))[1]
        with ex.phase("srs"):
            self._spar_reduce_scatter(ex, blocks, kb, list(range(m)), [])
        own = blocks[self.q].clone()
        blocks[self.q].zero_()
        self.last_stats = ex.stats.as_dict()
        self.memory.store_residual(name, working.view(tensor.shape))
        return own

    @staticmethod
    def _residual(
        working: torch.Tensor, n: int, selected: torch.Tensor, undo: Undo
    ) -> torch.Tensor:
        """Global Residual Collection in place of D: D at the selected positions, the
        compensated gradient A elsewhere. D differs from A only where this step wrote into it,
        and each write logged what it overwrote: undoing the writes in reverse order gives A
        back exactly, with no pass over the gradient."""
        kept = working.index_select(0, selected)
        for target, positions, values in reversed(undo):
            target.index_copy_(0, positions, values)
        working.index_copy_(0, selected, kept)
        return working[:n]

    def _spar_reduce_scatter(
        self, ex: Exchange, blocks: torch.Tensor, kb: int, team_ranks: list[int], undo: Undo
    ) -> None:
        """Spar-Reduce-Scatter: in each round of the schedule, send the top-k_b of the
        blocks due to the next worker and add in what the previous one sends."""
        m = blocks.shape[0]
        # None: sizes travel first
        expected = self.codec.fixed_size(kb, blocks.dtype, blocks.shape[1])
        for i, rnd in enumerate(srs_schedule(m)):
            dst = team_ranks[(self.q + rnd.distance) % m]
            src = team_ranks[(self.q - rnd.distance) % m]
            for b in range(rnd.blocks):
                out_block = (self.q + rnd.distance + b) % m
                in_block = (self.q + b) % m
                with ex.selecting():
                    chosen = topk_abs(blocks[out_block], kb, self.scratch)
                ex.exchange(
                    blocks[out_block],
                    chosen,
                    blocks[in_block],
                    dst,
                    src,
                    (f"srs.{out_block}", f"srs.{in_block}"),
                    f"{i}.{b}",
                    expected,
                    undo,
                )

    def _select_final(
        self,
        ex: Exchange,
        own: torch.Tensor,
        name: str,
        numel: int,
        density: float,
        undo: Undo,
    ) -> Encoded:
        """Choose this worker's block's final entries (cross-team merge when d > 1), subtract
        them from the working copy, and return them coded for the all-gather."""
        final_tag = f"final.{self.q}"
        kb = self.block_layout(numel, density)[1]
        if self.teams == 1:
            with ex.selecting():
                chosen = topk_abs(own, kb, self.scratch)
            with ex.phase("sag"):
                return ex.take(own, chosen, final_tag, undo)

        h = self.h_for(name, numel, density)
        with ex.selecting():
            chosen = topk_abs(own, h, self.scratch)
        group = [t * self.team_size + self.q for t in range(self.teams)]
        with ex.phase("cross"):
            piece = ex.take(own, chosen, f"cross.{self.q}.{self.team}", undo)
            # Every member of the group holds the same h (adapted from the same unions).
            coded = ex.bruck_allgather(
                piece.data, group, self.team, self.codec.fixed_size(h, own.dtype, own.numel())
            )
        union = torch.zeros_like(own)
        member = torch.zeros(own.numel(), dtype=torch.bool, device=own.device)
        for t, data in enumerate(coded):
            idx, vals = ex.decode(data, own.numel(), own, f"cross.{self.q}.{t}")
            union[idx] += vals
            member[idx] = True
        with ex.selecting():
            candidates = torch.nonzero(member).reshape(-1)
            self._adapt_h(name, numel, candidates.numel(), density)
            if candidates.numel() > kb:
                candidates = candidates[topk_abs(union[candidates], kb)]
        enc = ex.encode(union, candidates, final_tag)
        if self.team == 0:
            # Whatever the final coding changes is kept once, by team 0's owner.
            undo.append((own, enc.indices, own[enc.indices]))
            own[enc.indices] += union[enc.indices] - enc.values
        ex.stats.entries["sag"] += enc.indices.numel()
        return enc

    def _adapt_h(self, name: str, numel: int, union_size: int, density: float) -> None:
        block, kb = self.block_layout(numel, density)
        if kb >= block:
            return
        h = self.h_for(name, numel, density)
        estimate = h * kb / max(union_size, 1)
        new_h = round((1 - H_GAIN) * h + H_GAIN * estimate)
        self._h[name] = min(kb, max(math.ceil(kb / self.teams), new_h))

    def _own_state(self) -> dict[str, Any]:
        return {**super()._own_state(), "h": dict(self._h)}

    def _load_own_state(self, state: dict[str, Any]) -> None:
        super()._load_own_state(state)
        self._h = dict(state.get("h", {}))
