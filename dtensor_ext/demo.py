"""`python -m dtensor_ext demo`: a tensor-parallel transformer block on a simulated mesh, checked against one device.

The block (attention, RMSNorm, SwiGLU MLP) is sharded Megatron-style with `parallelize_module`: q/k/v and the MLP's
gate/up projections column-parallel, the output projections row-parallel. Forward and backward run on every rank
of the simulated mesh; the loss and every gradient are compared with the same block on one device.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_ext
from dtensor_ext.comm_stats import CommStatsMode
from dtensor_ext.testing.mesh import simulated_mesh


@dataclass(frozen=True)
class BlockConfig:
    dim: int = 64
    heads: int = 8
    hidden: int = 128
    batch: int = 2
    seq: int = 16


class Attention(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.wo(attn.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


# The residual stream stays a replicated DTensor; inside attention and the MLP ranks work on local head/hidden slices.
TP_PLAN = {
    "attn.wq": ColwiseParallel(),
    "attn.wk": ColwiseParallel(),
    "attn.wv": ColwiseParallel(),
    "attn.wo": RowwiseParallel(use_local_output=False),
    "mlp.gate": ColwiseParallel(),
    "mlp.up": ColwiseParallel(),
    "mlp.down": RowwiseParallel(use_local_output=False),
}


def check_mesh(ranks: int, cfg: BlockConfig) -> None:
    for what, size in (("heads", cfg.heads), ("hidden", cfg.hidden)):
        if ranks < 1 or size % ranks:
            raise ValueError(
                f"mesh of {ranks} tensor-parallel ranks: {what}={size} must be a multiple of the rank count "
                f"(try --ranks in {[r for r in range(1, size + 1) if size % r == 0 and cfg.heads % r == 0]})"
            )


@dataclass
class DemoResult:
    ranks: int
    loss: float
    reference_loss: float
    max_grad_error: float
    max_output_error: float
    sharded_ops: dict
    collectives: dict
    payload_bytes: dict
    seconds: float
    rules_used: list


def run_demo(ranks: int = 4, cfg: BlockConfig = BlockConfig(), seed: int = 0) -> DemoResult:
    check_mesh(ranks, cfg)
    start = time.perf_counter()
    torch.manual_seed(seed)
    reference = Block(cfg)
    model = copy.deepcopy(reference)
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim)
    target = torch.randn(cfg.batch, cfg.seq, cfg.dim)

    ref_out = reference(x)
    ref_loss = F.mse_loss(ref_out, target)
    ref_loss.backward()

    with simulated_mesh((ranks,), mesh_dim_names=("tp",)) as mesh:
        parallelize_module(model, mesh, TP_PLAN)
        for norm in (model.attn_norm, model.mlp_norm):  # norms: replicated parameters on the same mesh
            distribute_module(norm, mesh)
        with CommStatsMode() as mode:
            out = model(distribute_tensor(x, mesh, [Replicate()]))
            loss = F.mse_loss(out.full_tensor() if isinstance(out, DTensor) else out, target)
            loss.backward()
        out_err = _max_error(out, ref_out)
        grad_err = max(
            _max_error(p.grad, reference.get_parameter(n).grad) for n, p in model.named_parameters()
        )
        loss_value = _rank0(loss)

    stats = mode.stats
    ours = {e.op for e in dtensor_ext.registry() if e.status in ("added", "upgraded")}
    used = sorted(op for op in stats.sharded_ops if _op_name(op) in ours)
    return DemoResult(
        ranks, loss_value, ref_loss.item(), grad_err, out_err, dict(stats.sharded_ops), dict(stats.collectives),
        dict(stats.payload_bytes), time.perf_counter() - start, used,
    )


def _op_name(op: str) -> str:
    namespace, _, rest = op.partition(".")
    name, _, overload = rest.partition(".")
    return f"{namespace}::{name}.{overload or 'default'}"


def _rank0(t: torch.Tensor) -> float:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    values = getattr(t, "_local_tensors", None)
    return float(values[0] if values else t)


def _max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    if isinstance(got, DTensor):
        got = got.full_tensor()
    values = getattr(got, "_local_tensors", None)
    pieces = list(values.values()) if values else [got]
    return max(float((p.detach() - expected.detach()).abs().max()) for p in pieces)


def format_result(r: DemoResult) -> str:
    lines = [
        f"transformer block, tensor parallel on a simulated {r.ranks}-rank mesh vs one device ({r.seconds:.1f}s)",
        f"  loss {r.loss:.6f} (one device {r.reference_loss:.6f}); max |output error| {r.max_output_error:.2e}; "
        f"max |grad error| {r.max_grad_error:.2e}",
        f"  ops that ran on sharded inputs: {sum(r.sharded_ops.values())} calls of {len(r.sharded_ops)} ops",
    ]
    for op, n in sorted(r.sharded_ops.items()):
        lines.append(f"    {op:<40} x{n}")
    lines.append("  collectives (per rank payload):")
    for kind, n in sorted(r.collectives.items()):
        lines.append(f"    {kind:<16} x{n:<3} {r.payload_bytes[kind] / 1024:.1f} KiB")
    if r.rules_used:
        lines.append(f"  sharded through dtensor_ext rules: {', '.join(r.rules_used)}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=None, help="tensor-parallel ranks (default 4)")
    parser.add_argument("--mesh", type=str, default=None, help="mesh shape, e.g. 4 (one tensor-parallel dim)")
    parser.add_argument("--seed", type=int, default=0)


def parse_ranks(args: argparse.Namespace) -> int:
    if args.mesh is None:
        return 4 if args.ranks is None else args.ranks
    try:
        shape = [int(s) for s in args.mesh.split(",")]
    except ValueError:
        raise SystemExit(f"--mesh {args.mesh!r}: expected comma-separated positive integers, e.g. 4") from None
    if len(shape) != 1 or shape[0] < 1:
        raise SystemExit(f"--mesh {args.mesh!r}: the demo shards one tensor-parallel mesh dim; give one size, e.g. 4")
    if args.ranks is not None and args.ranks != shape[0]:
        raise SystemExit(f"--ranks {args.ranks} disagrees with --mesh {args.mesh}")
    return shape[0]


def run(args: argparse.Namespace) -> int:
    try:
        result = run_demo(parse_ranks(args), seed=args.seed)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(format_result(result))
    ok = result.max_grad_error < 1e-4 and result.max_output_error < 1e-4
    print("OK: matches one device" if ok else "MISMATCH against one device")
    return 0 if ok else 1
