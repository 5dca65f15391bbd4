"""Throughput of the expert-parallel layer: ``torchrun --nproc-per-node W -m dlblas_kernels.moe.bench``.

For each token count (per rank): the layer's tokens per second over the ``W`` ranks, the share of
its time spent in the exchange (dispatch and combine, each stage timed to its end on every rank, so
waiting for a slower rank counts as exchange), and the same computation on one device with all
experts (rank 0 alone, the other ranks waiting), whence the scaling from 1 to ``W`` devices.
NCCL on GPUs, gloo on CPUs (there use small sizes: the experts run as a torch loop). Routing is
uniform (softmax top-k of random logits). ``--check`` also compares every rank's output with the
one-device computation of its tokens (each rank then builds all experts' weights).

Without torchrun (no ``RANK`` in the environment) it runs as one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import dlblas_kernels
from dlblas_kernels.moe.exchange import ExchangeKind, rank_and_size
from dlblas_kernels.moe.layer import Compute, EPMoE
from dlblas_kernels.moe.routing import softmax_topk
from dlcore.api import table

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Result:
    """One token count's measurement (times in milliseconds, per forward)."""

    tokens_per_rank: int
    ranks: int
    exchange: str
    layer_ms: float
    dispatch_ms: float
    compute_ms: float
    combine_ms: float
    one_device_ms: float
    max_abs_error: float | None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_rank * self.ranks / (self.layer_ms / 1e3)

    @property
    def one_device_tokens_per_s(self) -> float:
        return self.tokens_per_rank / (self.one_device_ms / 1e3)

    @property
    def exchange_share(self) -> float:
        staged = self.dispatch_ms + self.compute_ms + self.combine_ms
        return (self.dispatch_ms + self.combine_ms) / staged if staged > 0 else 0.0

    def record(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s,
                "one_device_tokens_per_s": self.one_device_tokens_per_s, "exchange_share": self.exchange_share,
                "scaling": self.tokens_per_s / self.one_device_tokens_per_s}


def expert_loop(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """The MoE computation as a torch loop over the experts (the bench's stand-in where fused_moe is
    not to be had, e.g. on CPU): float32 accumulation, the result in ``hidden``'s dtype."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    inter = w2.shape[2]
    for expert in range(w13.shape[0]):
        token, choice = (topk_ids == expert).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = hidden[token] @ w13[expert].t()
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, token, (act @ w2[expert].t()).float() * topk_weights[token, choice].unsqueeze(1))
    return out.to(hidden.dtype)


def pick_compute(name: str, device: torch.device) -> Compute:
    if name == "loop" or (name == "auto" and device.type == "cpu"):
        return expert_loop
    return lambda *args: dlblas_kernels.fused_moe(*args)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Mean milliseconds of ``fn`` over ``iters`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iters * 1e3


def measure(args: argparse.Namespace, tokens: int, device: torch.device, compute: Compute) -> Result:
    rank, world = rank_and_size(None)
    dtype = DTYPES[args.dtype]
    experts, hidden_size, inter = args.experts, args.hidden, args.inter
    local = experts // world
    scale = hidden_size ** -0.5
    make = torch.Generator(device=device)

    def weights(seed: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        make.manual_seed(seed)
        w13 = torch.randn(count, 2 * inter, hidden_size, generator=make, device=device, dtype=dtype) * scale
        w2 = torch.randn(count, hidden_size, inter, generator=make, device=device, dtype=dtype) * inter ** -0.5
        return w13, w2

    make.manual_seed(1000 + rank)
    x = torch.randn(tokens, hidden_size, generator=make, device=device, dtype=dtype)
    logits = torch.randn(tokens, experts, generator=make, device=device)
    topk_weights, topk_ids = softmax_topk(logits, args.topk)

    if args.check:
        w13_all, w2_all = weights(0, experts)
        layer = EPMoE.from_experts(w13_all, w2_all, exchange=args.exchange, compute=compute)
    else:
        layer = EPMoE(*weights(1 + rank, local), exchange=args.exchange, compute=compute)
    layer_ms = timed(lambda: layer(x, topk_weights, topk_ids), device, args.iters, args.warmup)
    stages = [0.0, 0.0, 0.0]

    def staged() -> None:
        marks = [time.perf_counter()]
        received = layer.dispatch(x, topk_weights, topk_ids)
        synchronize(device)
        marks.append(time.perf_counter())
        out = layer.compute_experts(received)
        synchronize(device)
        marks.append(time.perf_counter())
        layer.exchange.combine(out, received)
        synchronize(device)
        marks.append(time.perf_counter())
        for i in range(3):
            stages[i] += (marks[i + 1] - marks[i]) * 1e3

    for _ in range(args.warmup):
        staged()
    stages[:] = [0.0, 0.0, 0.0]
    for _ in range(args.iters):
        staged()
    dispatch_ms, compute_ms, combine_ms = (s / args.iters for s in stages)

    error = None
    if args.check:
        expected = compute(x, w13_all, w2_all, topk_weights, topk_ids).float()
        error = float((layer(x, topk_weights, topk_ids).float() - expected).abs().max()) if tokens else 0.0
    one_device_ms = 0.0
    if rank == 0:
        w13_all, w2_all = (w13_all, w2_all) if args.check else weights(0, experts)
        one_device_ms = timed(lambda: compute(x, w13_all, w2_all, topk_weights, topk_ids), device, args.iters,
                              args.warmup)
    kind = layer.exchange.kind.value
    results = [one_device_ms, error if error is not None else -1.0]
    if world > 1:
        # the slowest rank's times (on the device: NCCL reduces device tensors only)
        gathered = torch.tensor([layer_ms, dispatch_ms, compute_ms, combine_ms, *results], dtype=torch.float64,
                                device=device)
        dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
        layer_ms, dispatch_ms, compute_ms, combine_ms, one_device_ms, err = gathered.tolist()
        error = err if args.check else None
    return Result(tokens, world, kind, layer_ms, dispatch_ms, compute_ms, combine_ms, one_device_ms, error)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dlblas_kernels.moe.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="tokens per rank (default 4096 16384)")
    p.add_argument("--experts", type=int, default=8, help="experts in all (default 8: Mixtral-8x7B)")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336, help="each expert's intermediate size")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--exchange", choices=[k.value for k in ExchangeKind], default=ExchangeKind.AUTO.value)
    p.add_argument("--compute", choices=["auto", "fused_moe", "loop"], default="auto",
                   help="the expert computation: fused_moe, or a torch loop over experts (auto: loop on CPU)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--check", action="store_true", help="compare each rank's output with one device's")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON (rank 0)")
    return p


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Run the bench (in the process group already initialised, or the one torchrun describes)."""
    args = parser().parse_args(argv)
    started = False
    if not dist.is_initialized() and "RANK" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        started = True
    rank, world = rank_and_size(None)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    compute = pick_compute(args.compute, device)
    results = [measure(args, tokens, device, compute) for tokens in args.tokens]
    records = [r.record() for r in results]
    if rank == 0:
        print(f"EPMoE: E {args.experts}, k {args.topk}, H {args.hidden}, I {args.inter}, {args.dtype}, {world} ranks, "
              f"exchange {results[0].exchange}, on {device.type}")
        header = ["tokens/rank", "layer ms", "tokens/s", "exchange %", "1-device ms", "1-device tokens/s", "scaling"]
        if args.check:
            header.append("max |err|")
        rows = []
        for r in records:
            row = [str(r["tokens_per_rank"]), f"{r['layer_ms']:.3f}", f"{r['tokens_per_s']:.4g}",
                   f"{100 * r['exchange_share']:.1f}", f"{r['one_device_ms']:.3f}",
                   f"{r['one_device_tokens_per_s']:.4g}", f"{r['scaling']:.2f}x"]
            if args.check:
                row.append(f"{r['max_abs_error']:.3g}")
            rows.append(row)
        print(table(rows, header))
        if args.json:
            with open(args.json, "w") as file:
                json.dump({"config": vars(args), "world_size": world, "results": records}, file, indent=1)
    if started:
        dist.destroy_process_group()
    return records


if __name__ == "__main__":
    main()
