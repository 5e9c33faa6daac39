"""`python -m dtensor_ext demo`: a tensor-parallel transformer block on a simulated mesh, checked against one device.

The block (causal SDPA attention, RMSNorm, SwiGLU MLP) is sharded Megatron-style with `parallelize_module`: q/k/v and the MLP's
gate/up projections column-parallel, the output projections row-parallel. Forward and backward run on every rank
of the simulated mesh; the loss and every gradient are compared with the same block on one device.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_ext
from dtensor_ext._compat import local_tensor_values
from dtensor_ext.tools.comm_stats import CommStatsMode
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
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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


# The same plan on a 2-D (dp, tp) mesh, written as placements: (data-parallel dim, tensor-parallel dim).
TP_DIMS_2D = {"attn.wq": 0, "attn.wk": 0, "attn.wv": 0, "attn.wo": 1, "mlp.gate": 0, "mlp.up": 0, "mlp.down": 1}


def check_mesh(mesh_shape: tuple[int, ...], cfg: BlockConfig) -> None:
    if not 1 <= len(mesh_shape) <= 2 or any(d < 1 for d in mesh_shape):
        raise ValueError(
            f"mesh {mesh_shape}: expected (tp,) or (dp, tp) with positive sizes, e.g. (4,) or (2, 2)"
        )
    tp = mesh_shape[-1]
    for what, size in (("heads", cfg.heads), ("hidden", cfg.hidden)):
        if size % tp:
            raise ValueError(
                f"mesh {mesh_shape}: {what}={size} must be a multiple of the {tp} tensor-parallel ranks "
                f"(tensor-parallel sizes that fit: {[r for r in range(1, cfg.heads + 1) if cfg.heads % r == 0]})"
            )
    if len(mesh_shape) == 2 and cfg.batch < mesh_shape[0]:
        raise ValueError(f"mesh {mesh_shape}: batch={cfg.batch} is smaller than the {mesh_shape[0]} data-parallel ranks")


def _shard_2d(model: Block, mesh) -> None:
    """dp x tp: weights replicated over dp and sharded over tp as in TP_PLAN; DTensor propagation does the rest."""
    for name, module in model.named_modules():
        for pname, param in list(module.named_parameters(recurse=False)):
            tp_dim = TP_DIMS_2D.get(name)
            placements = [Replicate(), Replicate() if tp_dim is None else Shard(tp_dim)]
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param.data, mesh, placements)))


@dataclass
class DemoResult:
    mesh_shape: tuple[int, ...]
    loss: float
    reference_loss: float
    max_grad_error: float
    max_output_error: float
    sharded_ops: dict
    collectives: dict
    payload_bytes: dict
    seconds: float
    rules_used: list


def run_demo(mesh_shape: tuple[int, ...] = (4,), cfg: BlockConfig = BlockConfig(), seed: int = 0) -> DemoResult:
    mesh_shape = tuple(mesh_shape)
    check_mesh(mesh_shape, cfg)
    start = time.perf_counter()
    torch.manual_seed(seed)
    reference = Block(cfg)
    model = copy.deepcopy(reference)
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim)
    target = torch.randn(cfg.batch, cfg.seq, cfg.dim)

    ref_out = reference(x)
    ref_loss = F.mse_loss(ref_out, target)
    ref_loss.backward()

    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    with simulated_mesh(mesh_shape, mesh_dim_names=names) as mesh:
        if len(mesh_shape) == 1:
            parallelize_module(model, mesh, TP_PLAN)
            for norm in (model.attn_norm, model.mlp_norm):  # norms: replicated parameters on the same mesh
                distribute_module(norm, mesh)
            batch_layout = [Replicate()]
        else:
            _shard_2d(model, mesh)
            batch_layout = [Shard(0), Replicate()]
        with CommStatsMode() as mode:
            out = model(distribute_tensor(x, mesh, batch_layout))
            loss = F.mse_loss(out, distribute_tensor(target, mesh, batch_layout))
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
        mesh_shape, loss_value, ref_loss.item(), grad_err, out_err, dict(stats.sharded_ops), dict(stats.collectives),
        dict(stats.payload_bytes), time.perf_counter() - start, used,
    )


def _op_name(op: str) -> str:
    namespace, _, rest = op.partition(".")
    name, _, overload = rest.partition(".")
    return f"{namespace}::{name}.{overload or 'default'}"


def _rank0(t: torch.Tensor) -> float:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    values = local_tensor_values(t)
    return float(values[0] if values else t)


def _max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    if isinstance(got, DTensor):
        got = got.full_tensor()
    pieces = list((local_tensor_values(got) or {0: got}).values())
    return max(float((p.detach() - expected.detach()).abs().max()) for p in pieces)


def format_result(r: DemoResult) -> str:
    lines = [
        f"transformer block on a simulated {'x'.join(map(str, r.mesh_shape))}{'-rank' if len(r.mesh_shape) == 1 else ''} mesh "
        f"({'tensor parallel' if len(r.mesh_shape) == 1 else 'data x tensor parallel'}) vs one device "
        f"({r.seconds:.1f}s)",
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
    parser.add_argument("--ranks", type=int, default=None, help="tensor-parallel ranks of a 1-D mesh (default 4)")
    parser.add_argument("--mesh", type=str, default=None, help="mesh shape: 'tp' or 'dp,tp', e.g. 4 or 2,2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fast-propagation", action="store_true", help="expand single-dim rules with dtensor_ext's search"
    )


def parse_mesh(args: argparse.Namespace) -> tuple[int, ...]:
    if args.mesh is None:
        return (4 if args.ranks is None else args.ranks,)
    try:
        shape = tuple(int(s) for s in args.mesh.split(","))
    except ValueError:
        raise SystemExit(f"--mesh {args.mesh!r}: expected comma-separated positive integers, e.g. 4 or 2,2") from None
    if args.ranks is not None and args.ranks != shape[-1]:
        raise SystemExit(f"--ranks {args.ranks} disagrees with the tensor-parallel size of --mesh {args.mesh}")
    return shape


def run(args: argparse.Namespace) -> int:
    if args.fast_propagation:
        dtensor_ext.install(fast_propagation=True)
    try:
        result = run_demo(parse_mesh(args), seed=args.seed)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(format_result(result))
    ok = result.max_grad_error < 1e-4 and result.max_output_error < 1e-4
    print("OK: matches one device" if ok else "MISMATCH against one device")
    return 0 if ok else 1
