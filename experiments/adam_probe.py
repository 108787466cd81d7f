"""Why sparse gradients trail under AdamW, measured in one process: P workers simulated in turn
on the transformer of the front, each step's P gradients synchronised by top-k with error
feedback (each worker keeps its own residual; the average of what they send is the step's
gradient), then one of several updates.

    python -m experiments.adam_probe --variants dense,topk,frozen,preconditioned --steps 600 \\
        --out experiments/results/adam_probe

Variants:
  dense           AdamW on the dense average (the reference)
  topk            AdamW on the top-k average (what the library does today under AdamW)
  frozen          dense AdamW for --dense-steps, then AdamW with its second moment frozen on
                  the top-k average (1-bit Adam's remedy: the update becomes linear in the
                  gradient, so what error feedback delays arrives with its full weight)
  preconditioned  as frozen, but each worker selects and accumulates its gradient divided by
                  the frozen sqrt(v) (top-k in the units of the update)
  update          each worker runs AdamW's moments on its own (clipped) gradient and sends
                  the top-k of its residual plus its own step (lr times m / sqrt(v)); the
                  average of what they send is applied, weight decay beside it on every
                  worker alike: the update, not the gradient, is compressed, so what error
                  feedback delays arrives as the movement Adam asked for
  update_frozen   dense AdamW for --dense-steps (so every worker holds the same second
                  moment), then as update with that variance frozen: each worker's step is
                  lr m_w / sqrt(v), linear in its own momentum, so at density 1 the average is
                  exactly AdamW's frozen step on the average gradient (1-bit Adam's update),
                  and the top-k selects by the size of the step it would take
  update_localfrozen
                  as update for --dense-steps (no dense synchronisation: each worker's AdamW
                  on its own gradient, its step exchanged top-k with error feedback), then
                  the workers' second moments averaged once (one dense exchange of v) and
                  frozen, and each worker's frozen-variance step exchanged as in
                  update_frozen: the frozen variance without the dense start's bytes

It also records, per variant, how far each parameter entry moved over the run against dense
AdamW's movement (the ratio of the L2 norms of the total displacement, and of the sum of each
step's update norms: AdamW's per-entry normalisation turns a residual burst into a step of
full size, so the path is long and the displacement short). Writes OUT/VARIANT.json (loss
curve, validation loss every --eval-every steps, movement) and OUT/summary.md.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from testbed.models import DecoderLM
from testbed.text import CHAR_VOCAB, load_wikipedia_chars

VARIANTS = ("dense", "topk", "frozen", "preconditioned", "update", "update_frozen",
            "update_localfrozen")
BETAS, EPS = (0.9, 0.95), 1e-8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--select", default="topk", choices=("topk", "sign", "sign2"),
                   help="update_frozen's compression: top-k at --density, 1-bit signs "
                        "averaged, or signs averaged and sent again as signs (sign2: 1-bit "
                        "Adam's compressed all-reduce, error feedback on both sides)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--mask-momentum", action="store_true",
                   help="update_frozen with top-k: zero each worker's momentum where it sent "
                        "(DGC's momentum factor masking)")
    p.add_argument("--dense-steps", type=int, default=60, help="frozen, preconditioned")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--test-samples", type=int, default=800)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/adam_probe")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant {bad[0]!r}; valid choices: {', '.join(VARIANTS)}")
    frozen = {"update_frozen", "update_localfrozen"}
    if (args.select != "topk" or args.mask_momentum) and not frozen & set(args.variants):
        p.error("--select and --mask-momentum change update_frozen and update_localfrozen only")
    if args.mask_momentum and args.select != "topk":
        p.error("--mask-momentum zeroes the momentum where top-k sent: use --select topk")
    return args


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(args.steps - args.warmup_steps, 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def signs(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """What one bit an entry sends of `x`: its sign times the mean magnitude of each parameter
    tensor (the consecutive pieces of `sizes` entries)."""
    scale = torch.cat([c.abs().mean().expand(c.numel()) for c in x.split(sizes)])
    return x.sign() * scale


def sign_average(grads: list[torch.Tensor], residuals: list[torch.Tensor],
                 sizes: list[int]) -> torch.Tensor:
    """The average of each worker's signs of (residual + gradient) (1-bit Adam's compression,
    one bit an entry); residuals keep the rest."""
    out = torch.zeros_like(grads[0])
    for g, e in zip(grads, residuals):
        e.add_(g)
        sent = signs(e, sizes)
        out += sent
        e.sub_(sent)
    return out.div_(len(grads))


def sign_twice(grads: list[torch.Tensor], residuals: list[torch.Tensor], server: torch.Tensor,
               sizes: list[int]) -> torch.Tensor:
    """1-bit Adam's compressed all-reduce: sign_average, then the average itself sent as signs
    times its mean magnitude per tensor, with the server's own error feedback (`server`), as
    the rank owning each chunk sends it back to all."""
    average = sign_average(grads, residuals, sizes).add_(server)
    sent = signs(average, sizes)
    server.copy_(average - sent)
    return sent


def topk_average(grads: list[torch.Tensor], residuals: list[torch.Tensor], k: int) -> torch.Tensor:
    """The average of each worker's top-k of (residual + gradient); residuals keep the rest."""
    out = torch.zeros_like(grads[0])
    for g, e in zip(grads, residuals):
        e.add_(g)
        idx = e.abs().topk(k, sorted=False).indices
        out[idx] += e[idx]
        e[idx] = 0
    return out.div_(len(grads))


class Probe:
    """One variant's run: the model, AdamW's moments as flat vectors, the residuals."""

    def __init__(self, variant: str, args: argparse.Namespace, n: int):
        self.variant, self.args = variant, args
        torch.manual_seed(args.seed)
        self.model = DecoderLM(CHAR_VOCAB)
        self.params = list(self.model.parameters())
        self.decay = torch.cat([torch.full((p.numel(),), float(p.dim() >= 2)) for p in self.params])
        self.m, self.v = torch.zeros(n), torch.zeros(n)
        # 'update': each worker's own moments
        self.local = [(torch.zeros(n), torch.zeros(n)) for _ in range(args.workers)] \
            if variant.startswith("update") else []
        self.v_frozen: torch.Tensor | None = None
        self.residuals = [torch.zeros(n) for _ in range(args.workers)]
        self.server = torch.zeros(n)  # sign2's error feedback of the averaged step
        self.k = max(1, round(args.density * n))
        self.start = self.flat().clone()
        self.path = torch.zeros(n)  # sum of |update| per entry

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def gradients(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list, float]:
        grads, loss_sum = [], 0.0
        for x, y in batches:
            self.model.zero_grad()
            loss = F.cross_entropy(self.model(x).reshape(-1, CHAR_VOCAB), y.reshape(-1))
            loss.backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in self.params]))
            loss_sum += loss.item()
        return grads, loss_sum / len(batches)

    def step(self, step: int, grads: list[torch.Tensor]) -> None:
        args = self.args
        lr = lr_at(step, args)
        dense_phase = self.variant == "dense" or (
            self.variant in ("frozen", "preconditioned", "update_frozen")
            and step < args.dense_steps)
        if self.variant == "update_localfrozen" and self.v_frozen is None:
            self._apply(self._update_average(step, grads, lr)
                        + lr * args.weight_decay * self.decay * self.flat())
            if step == args.dense_steps - 1:
                average = torch.stack([v for _, v in self.local]).mean(0)
                self.v_frozen = average / (1 - BETAS[1] ** (step + 1))
            return
        if self.variant in ("update_frozen", "update_localfrozen") and not dense_phase:
            self._apply(self._frozen_update_average(step, grads, lr)
                        + lr * args.weight_decay * self.decay * self.flat())
            return
        if self.variant == "update":
            self._apply(self._update_average(step, grads, lr)
                        + lr * args.weight_decay * self.decay * self.flat())
            return
        if self.variant == "preconditioned" and not dense_phase:
            scale = self.v_frozen.sqrt().add_(EPS)
            g = topk_average([x / scale for x in grads], self.residuals, self.k)
            update = self._momentum(g, step)
        else:
            g = torch.stack(grads).mean(0) if dense_phase else \
                topk_average(grads, self.residuals, self.k)
            norm = g.norm()
            if norm > args.clip_norm:
                g.mul_(args.clip_norm / norm)
            if dense_phase or self.variant == "topk":
                update = self._adam(g, step)
            else:
                update = self._momentum(g, step) / self.v_frozen.sqrt().add_(EPS)
        if self.variant in ("frozen", "preconditioned", "update_frozen") \
                and step == args.dense_steps - 1:
            self.v_frozen = self.v / (1 - BETAS[1] ** (step + 1))
            for m, _ in self.local:  # the dense phase's momentum is every worker's
                m.copy_(self.m)
        self._apply(lr * (update + args.weight_decay * self.decay * self.flat()))

    def _update_average(self, step: int, grads: list[torch.Tensor], lr: float) -> torch.Tensor:
        """'update': the average of the workers' top-k of (residual + own AdamW step)."""
        steps, t = [], step + 1
        for g, (m, v) in zip(grads, self.local):
            norm = g.norm()
            if norm > self.args.clip_norm:
                g = g * (self.args.clip_norm / norm)
            m.lerp_(g, 1 - BETAS[0])
            v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            steps.append(lr * (m / (1 - BETAS[0] ** t)) / ((v / (1 - BETAS[1] ** t)).sqrt() + EPS))
        return topk_average(steps, self.residuals, self.k)

    def _frozen_update_average(self, step: int, grads: list[torch.Tensor], lr: float
                               ) -> torch.Tensor:
        """'update_frozen' after the dense phase: the average of the workers' top-k of
        (residual + lr m_w / sqrt(v_frozen)), m_w each worker's momentum of its own gradient."""
        steps, scale = [], self.v_frozen.sqrt().add_(EPS)
        for g, (m, _) in zip(grads, self.local):
            norm = g.norm()
            if norm > self.args.clip_norm:
                g = g * (self.args.clip_norm / norm)
            m.lerp_(g, 1 - BETAS[0])
            steps.append(lr * (m / (1 - BETAS[0] ** (step + 1))) / scale)
        if self.args.mask_momentum and self.args.select == "topk":
            sent = topk_average(steps, self.residuals, self.k)
            for e, (m, _) in zip(self.residuals, self.local):
                m[e == 0] = 0  # DGC's momentum factor masking: a sent entry's momentum is spent
            return sent
        if self.args.select == "sign2":
            return sign_twice(steps, self.residuals, self.server, [p.numel() for p in self.params])
        if self.args.select == "sign":
            return sign_average(steps, self.residuals, [p.numel() for p in self.params])
        return topk_average(steps, self.residuals, self.k)

    def _apply(self, update: torch.Tensor) -> None:
        self.path += update.abs()
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.sub_(update[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def _adam(self, g: torch.Tensor, step: int) -> torch.Tensor:
        self.m.lerp_(g, 1 - BETAS[0])
        self.v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
        t = step + 1
        return (self.m / (1 - BETAS[0] ** t)) / ((self.v / (1 - BETAS[1] ** t)).sqrt() + EPS)

    def _momentum(self, g: torch.Tensor, step: int) -> torch.Tensor:
        self.m.lerp_(g, 1 - BETAS[0])
        return self.m / (1 - BETAS[0] ** (step + 1))

    def validation_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.eval()
        with torch.no_grad():
            loss = F.cross_entropy(self.model(x).reshape(-1, CHAR_VOCAB), y.reshape(-1)).item()
        self.model.train()
        return loss


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    x, y = load_wikipedia_chars("train")
    tx, ty = load_wikipedia_chars("test")
    chosen = torch.arange(args.test_samples) * len(tx) // args.test_samples
    tx, ty = tx[chosen], ty[chosen]
    n = sum(p.numel() for p in DecoderLM(CHAR_VOCAB).parameters())
    results = {}
    for variant in args.variants:
        probe = Probe(variant, args, n)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed))
        curve, evals, started = [], [], time.perf_counter()
        per_step = args.workers * args.batch_size
        for step in range(args.steps):
            rows = order[(step * per_step) % (len(x) - per_step):][:per_step]
            batches = [(x[rows[w::args.workers]], y[rows[w::args.workers]])
                       for w in range(args.workers)]
            grads, loss = probe.gradients(batches)
            probe.step(step, grads)
            curve.append(loss)
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                evals.append((step + 1, probe.validation_loss(tx, ty)))
                print(f"{variant} step {step + 1}: validation loss {evals[-1][1]:.4f}", flush=True)
        results[variant] = {"variant": variant, "train_loss": curve, "validation": evals,
                            "displacement": (probe.flat() - probe.start).norm().item(),
                            "path": probe.path.norm().item(),
                            "seconds": time.perf_counter() - started, "config": vars(args)}
        (out / f"{variant}.json").write_text(json.dumps(results[variant]))
    (out / "summary.md").write_text(summary(results, args))
    print(summary(results, args))
    return results


def summary(results: dict, args: argparse.Namespace) -> str:
    dense = results.get("dense")
    lines = [f"{args.workers} simulated workers x batch {args.batch_size}, {args.steps} steps, "
             f"density {args.density}, lr {args.lr}, seed {args.seed}", "",
             "| variant | validation loss | vs dense | displacement / dense's | path / dense's |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        loss = r["validation"][-1][1]
        rel = (lambda key: f"{r[key] / dense[key]:.2f}") if dense else (lambda key: "-")
        gap = f"{loss - dense['validation'][-1][1]:+.4f}" if dense else "-"
        lines.append(f"| {name} | {loss:.4f} | {gap} | {rel('displacement')} | {rel('path')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
