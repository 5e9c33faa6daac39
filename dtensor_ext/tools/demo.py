"""`python -m dtensor_ext demo`: an MoE Llama trained on a (dp, tp) mesh from its shipped YAML policy, step by step
against the same model on one device, with the package and with torch alone.

The model is `dtensor_ext.models.TinyLlama` (MoE feed-forwards unless `--dense`), parallelized by
`dtensor_ext.policy.parallelize` from `policies/llama_tp_sp.yaml` on the tp mesh dim (the plan is searched by the
policy adapter within the policy's constraints, experts included); the batch is sharded on dp and gradients are averaged over dp in one
bucketed all-reduce, as DDP does. Torch alone runs the same job with torchtitan's hand-written plan
(`torchtitan_plan`) and the package uninstalled. Collectives are counted by `comm_stats` (bytes the busiest rank
receives) and by torch's CommDebugMode from what ran. On simulated ranks (default) every rank lives in this
process; under `torchrun --nproc-per-node N` the ranks are real gloo processes. The package's redistribution
planner stays off, as it does by default (`--planner` turns it on).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import math
import os
import re
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_ext
from dtensor_ext._compat import (LocalTensor, enabled_local_tensor_mode, funcol, local_tensor_values,
                                 outside_simulated_ranks)
from dtensor_ext.models import LlamaConfig, TinyLlama, torchtitan_plan
from dtensor_ext.redistribute import engine
from dtensor_ext.testing.mesh import simulated_mesh
from dtensor_ext.tools.arguments import int_list, output_file, positive_int
from dtensor_ext.tools.comm_stats import CommStatsMode

BATCH_PER_DP_RANK, SEQ, LR = 2, 16, 1e-2


def demo_config(dense: bool = False, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, dim=32, n_heads=4, hidden_dim=32, n_layers=layers,
                       n_experts=0 if dense else 4, top_k=2)


@dataclass
class StepStats:
    loss: float
    reference_loss: float
    grad_error: float
    collectives: dict  # kind -> calls (comm_stats)
    received_bytes: dict  # kind -> bytes the busiest rank received
    commdebug_count: int  # the same collectives counted by torch's CommDebugMode

    @property
    def loss_error(self) -> float:
        return abs(self.loss - self.reference_loss)


@dataclass
class JobResult:
    steps: list[StepStats] = field(default_factory=list)
    ops: Counter = field(default_factory=Counter)  # DTensor op -> calls
    failure: str | None = None  # "step N: ExceptionType: first line"
    seconds: float = 0.0
    plan: list[str] = field(default_factory=list)  # the parallelization the job applied, one line per style


@dataclass
class DemoReport:
    mesh_shape: tuple[int, ...]
    config: LlamaConfig
    real_ranks: bool
    package: JobResult
    torch_alone: JobResult | None
    package_ops: dict  # op -> calls, for ops that ran through the package's rules or torch fixes
    seconds: float
    with_package: bool = True
    planner: bool = False
    svg: Path | None = None


def check_mesh(mesh_shape: tuple[int, ...], cfg: LlamaConfig) -> None:
    if not 1 <= len(mesh_shape) <= 2 or any(d < 1 for d in mesh_shape):
        raise ValueError(f"mesh {mesh_shape}: expected (tp,) or (dp, tp) with positive sizes, e.g. (4,) or (2, 2)")
    tp = mesh_shape[-1]
    for what, size in (("n_heads", cfg.n_heads), ("sequence", SEQ), ("vocab_size", cfg.vocab_size),
                       ("hidden_dim", cfg.hidden_dim)):
        if size % tp:
            raise ValueError(f"mesh {mesh_shape}: {what}={size} must be a multiple of the {tp} tensor-parallel ranks")


def _values(t: torch.Tensor) -> list[torch.Tensor]:
    """Every simulated rank's value of `t` (one value on a real rank)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    values = local_tensor_values(t)
    return list(values.values()) if values else [t]


def _max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return max(float((v.detach() - expected.detach()).abs().max()) for v in _values(got))


def _average_gradients_over_dp(model: torch.nn.Module, mesh) -> None:
    """DDP's bucketed all-reduce by hand: every rank's gradient as its parameter's layout, averaged over dp."""
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    if mesh.ndim == 1:
        return
    locals_ = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in locals_])
    flat = funcol.all_reduce(flat, "sum", (mesh, 0)) / mesh.size(0)
    for p, chunk in zip(params, flat.split([g.numel() for g in locals_])):
        chunk = chunk.view_as(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        p.grad = (DTensor.from_local(chunk, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                  if isinstance(p, DTensor) else chunk)


def _parallelize(model: TinyLlama, mesh, tokens: torch.Tensor, with_package: bool) -> list[str]:
    """Applies the job's plan; returns it as "modules: style" lines, layers folded into "layers.*"."""
    tp_mesh = mesh["tp"] if mesh.ndim == 2 else mesh
    if with_package:
        from dtensor_ext.policy import parallelize

        # on tp: each dp rank feeds its own tokens; the policy places every parameter, experts included
        parallelize(model, tp_mesh, (tokens,), constraints=model.config.policy_file)
        styles = {fqn: "(" + ", ".join(map(str, placements)) + ")"  # the solved placement of each sharded parameter
                  for fqn, placements in model.policy_plan.params.items()
                  if not all(isinstance(p, Replicate) for p in placements)}
    else:
        plan = torchtitan_plan(model.config)
        styles = {fqn: type(style).__name__ for fqn, style in plan.items()}
        parallelize_module(model, tp_mesh, plan)
    return _fold_layers(styles)


def _fold_layers(styles: dict[str, str]) -> list[str]:
    by_style: dict[str, list[str]] = {}
    for fqn, style in styles.items():
        names = by_style.setdefault(style, [])
        folded = re.sub(r"\.\d+(\.|$)", r".*\1", fqn)
        if folded not in names:
            names.append(folded)
    return [f"{', '.join(names)}: {style}" for style, names in by_style.items()]


def _unshare_replicas(model: torch.nn.Module) -> None:
    """On simulated ranks a replicated DTensor may hold one plain tensor for every rank (`distribute_tensor`,
    torch's SequenceParallel); an optimizer's in-place update with a per-rank gradient then updates that one
    tensor once per rank. Each rank gets its own copy; real ranks already have theirs."""
    mode = enabled_local_tensor_mode()
    if mode is None:
        return
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor) and local_tensor_values(param.to_local()) is None:
                local = param.to_local().detach()
                own = DTensor.from_local(LocalTensor({r: local.clone() for r in mode.ranks}), param.device_mesh,
                                         param.placements, run_check=False, shape=param.shape, stride=param.stride())
                module.register_parameter(name, torch.nn.Parameter(own, requires_grad=param.requires_grad))


def _short(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    first = next((line for line in lines if line.strip()), "")
    return f"{type(e).__name__}: {first[:150]}"


@contextlib.contextmanager
def _quiet():
    """Without torch's log of a meta kernel's refusal (a traceback per call, logged before the exception that the
    report names in one line), and without a warning about the policy's backward hooks, which fire on module
    outputs because token ids need no gradient."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
            yield
    finally:
        log.setLevel(level)


def _train(job: JobResult, model, reference, mesh, batches, with_package: bool, progress, label: str) -> None:
    """Trains `model` on the mesh and `reference` on one device in lockstep; stops at the first exception."""
    start = time.perf_counter()
    dp = mesh.size(0) if mesh.ndim == 2 else 1
    batch_layout = [Shard(0), Replicate()] if mesh.ndim == 2 else [Replicate()]
    step = 0
    try:
        job.plan = _parallelize(model, mesh, batches[0][0][: BATCH_PER_DP_RANK], with_package)
        _unshare_replicas(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, foreach=True)
        for step, (tokens, targets) in enumerate(batches, 1):
            with outside_simulated_ranks():  # one device: plain tensors, not a simulated rank's
                ref_loss = F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten())
                ref_loss.backward()
            local_tokens = distribute_tensor(tokens, mesh, batch_layout).to_local()  # this rank's dp slice
            local_targets = distribute_tensor(targets, mesh, batch_layout).to_local()
            with CommDebugMode() as debug, CommStatsMode() as stats:
                loss = F.cross_entropy(model(local_tokens).flatten(0, 1), local_targets.flatten())
                loss.backward()
                _average_gradients_over_dp(model, mesh)
            job.ops.update(stats.stats.sharded_ops)
            job.ops.update(stats.stats.replicated_ops)
            if dp > 1:
                loss = funcol.all_reduce(loss.detach(), "sum", (mesh, 0)) / dp
            grad_error = max(_max_error(p.grad, reference.get_parameter(n).grad) for n, p in model.named_parameters())
            job.steps.append(StepStats(
                max(float(v) for v in _values(loss)), ref_loss.item(), grad_error, dict(stats.stats.collectives),
                dict(stats.stats.received_bytes), sum(debug.get_comm_counts().values())))
            optimizer.step()
            with outside_simulated_ranks():  # on 2.11, foreach AdamW of plain tensors drifted inside the simulation
                ref_optimizer.step()
            optimizer.zero_grad(), ref_optimizer.zero_grad()
            progress(label, step, len(batches), job.steps[-1])
    except Exception as e:  # torch alone is expected to fail, the package on known limits: what failed, where
        job.failure = f"step {step}: {_short(e)}"
        progress(label, step, len(batches), None)
    job.seconds = time.perf_counter() - start


def _print_progress(label: str, step: int, steps: int, s: StepStats | None) -> None:
    if s is None:
        print(f"  [{label}] step {step}/{steps} failed", flush=True)
        return
    kib = _bytes(s) / 1024
    print(f"  [{label}] step {step:>2}/{steps}  loss {s.loss:.4f} (one device {s.reference_loss:.4f})  "
          f"|grad err| {s.grad_error:.1e}  {sum(s.collectives.values())} collectives, {kib:.1f} KiB/rank", flush=True)


def _batches(cfg: LlamaConfig, dp: int, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (BATCH_PER_DP_RANK * dp, SEQ)
    return [(torch.randint(0, cfg.vocab_size, shape, generator=gen),
             torch.randint(0, cfg.vocab_size, shape, generator=gen)) for _ in range(steps)]


def _mesh(mesh_shape: tuple[int, ...], real_ranks: bool):
    names = ("dp", "tp") if len(mesh_shape) == 2 else ("tp",)
    if real_ranks:
        from contextlib import nullcontext

        from torch.distributed.device_mesh import init_device_mesh

        return nullcontext(init_device_mesh("cpu", mesh_shape, mesh_dim_names=names))
    return simulated_mesh(mesh_shape, mesh_dim_names=names)


def _package_ops(ops: Counter) -> dict:
    ours = {e.op: e.status for e in dtensor_ext.registry() if e.status in ("added", "upgraded", "fixed")}
    return {op: n for op, n in sorted(ops.items()) if _op_name(op) in ours}


def _op_name(op: str) -> str:
    namespace, _, rest = op.partition(".")
    name, _, overload = rest.partition(".")
    return f"{namespace}::{name}.{overload or 'default'}"


def run_demo(mesh_shape=(2, 2), steps: int = 10, dense: bool = False, layers: int = 2, with_package: bool = True,
             compare_torch: bool = True, seed: int = 0, svg: Path | None = None, progress=_print_progress,
             real_ranks: bool = False, planner: bool = False) -> DemoReport:
    mesh_shape = tuple(mesh_shape)
    cfg = demo_config(dense, layers)
    check_mesh(mesh_shape, cfg)
    if steps < 1:
        raise ValueError(f"steps={steps}: expected at least 1")
    start = time.perf_counter()
    torch.manual_seed(seed)
    initial = TinyLlama(cfg)  # built (and the batches made) before any simulated mesh: per-rank values inside
    batches = _batches(cfg, mesh_shape[0] if len(mesh_shape) == 2 else 1, steps, seed)
    jobs = {}
    for use_package in ([True, False] if with_package and compare_torch else [with_package]):
        was_installed, planner_was_on = dtensor_ext.is_installed(), engine.is_enabled()
        dtensor_ext.install(planner=planner) if use_package else dtensor_ext.uninstall()
        try:
            job = jobs[use_package] = JobResult()
            with _mesh(mesh_shape, real_ranks) as mesh, _quiet():
                _train(job, copy.deepcopy(initial), copy.deepcopy(initial), mesh, batches, use_package, progress,
                       "dtensor_ext" if use_package else "torch alone")
        finally:
            dtensor_ext.install(planner=planner_was_on) if was_installed else dtensor_ext.uninstall()
    package = jobs.get(True) or jobs[False]
    report = DemoReport(mesh_shape, cfg, real_ranks, package, jobs.get(False) if with_package else None,
                        _package_ops(package.ops) if with_package else {}, time.perf_counter() - start,
                        with_package=with_package, planner=planner)
    if svg is not None:
        from dtensor_ext.tools.demo_picture import write_svg

        report.svg = write_svg(report, svg)
    return report


def _bytes(s: StepStats) -> int:
    return sum(s.received_bytes.values())


def _collectives(s: StepStats) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(s.collectives.items())) or "none"


def _matches(job: JobResult) -> bool:
    return bool(job.steps) and job.failure is None and max(max(s.loss_error, s.grad_error) for s in job.steps) < 1e-3


def _policy_name(cfg: LlamaConfig) -> str:
    path = Path(cfg.policy_file).resolve()
    root = Path(dtensor_ext.__file__).resolve().parents[1]
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def format_report(r: DemoReport) -> str:
    cfg, pkg, alone = r.config, r.package, r.torch_alone
    with_package = r.with_package
    kind = f"MoE Llama ({cfg.n_experts} experts, top-{cfg.top_k})" if cfg.n_experts else "dense Llama"
    ranks = "real gloo ranks" if r.real_ranks else "simulated ranks"
    mesh = "x".join(map(str, r.mesh_shape))
    who = "with dtensor_ext" + (" (its redistribution planner on)" if r.planner else "") if with_package else \
        "torch alone (torchtitan's plan, package uninstalled)"
    lines = [
        f"{kind}, {cfg.n_layers} layers, dim {cfg.dim}: {len(pkg.steps)} AdamW steps on a {mesh} "
        f"{'(dp, tp)' if len(r.mesh_shape) == 2 else '(tp)'} mesh of {ranks} vs one device, {who} ({r.seconds:.1f} s)",
    ]
    if with_package and pkg.plan:
        lines.append(f"  plan from the YAML policy {_policy_name(cfg)} (sharded parameters, as solved):")
        lines += [f"    {line}" for line in pkg.plan]
    if pkg.steps:
        lines.append(
            f"  max |loss error| {max(s.loss_error for s in pkg.steps):.1e}, max |grad error| "
            f"{max(s.grad_error for s in pkg.steps):.1e} over {len(pkg.steps)} steps "
            f"(loss {pkg.steps[0].loss:.3f} -> {pkg.steps[-1].loss:.3f})")
        s = pkg.steps[-1]
        lines.append(f"  per step: {_collectives(s)}; {_bytes(s):,} bytes received by the busiest rank "
                     f"(CommDebugMode counts {s.commdebug_count} collectives)")
    if pkg.failure:
        lines.append(f"  FAILED at {pkg.failure}")
    by_status = {}
    for op, n in r.package_ops.items():
        by_status.setdefault(_status(op), []).append(f"{op.removeprefix('aten.')} x{n}")
    if by_status.get("added"):
        lines.append(f"  ops torch has no strategy for, run by the package's rules: {', '.join(by_status['added'])}")
    if by_status.get("direct"):
        lines.append("  ops torch reaches only through its decomposition fallback, run by the package's direct rules: "
                     + ", ".join(by_status["direct"]))
    if by_status.get("fixed"):
        lines.append("  ops through a torch fix (it changes only the layouts torch gets wrong): "
                     + ", ".join(by_status["fixed"]))
    if alone is not None:
        lines += _versus_torch_alone(pkg, alone)
    if r.svg is not None:
        lines.append(f"  picture: {r.svg}")
    return "\n".join(lines)


def _status(op: str) -> str:
    """"added" (torch has no strategy), "direct" (a rule where torch has only its decomposition fallback) or
    "fixed" (through a torch fix)."""
    entries = [e for e in dtensor_ext.registry() if e.op == _op_name(op) and e.status in ("added", "upgraded")]
    if not entries:
        return "fixed"
    return "direct" if entries[0].torch_strategy == "decomposition" else "added"


def _versus_torch_alone(pkg: JobResult, alone: JobResult) -> list[str]:
    """What torch alone did with the same job, and so what the package added on this torch."""
    head = f"  torch alone (torchtitan's hand-written plan, package uninstalled, torch {torch.__version__}):"
    if alone.failure:
        return [f"{head} fails at {alone.failure}"] + (
            ["  -> the package makes this job run, and match one device"] if _matches(pkg) else [])
    worst = max(max(s.loss_error, s.grad_error) for s in alone.steps)
    a, p = alone.steps[-1], pkg.steps[-1] if pkg.steps else None
    lines = [f"{head} {len(alone.steps)} steps, {'matches one device' if worst < 1e-3 else 'WRONG'} "
             f"(max error {worst:.1e}); per step {_collectives(a)}; {_bytes(a):,} bytes received by the busiest rank"]
    if worst >= 1e-3:
        lines.append("  -> the package makes this job right")
    elif p is not None and _bytes(p) == _bytes(a):
        same = ("result, collectives and bytes" if p.collectives == a.collectives
                else "result and bytes, other collectives,")
        lines.append(f"  -> same {same} as torch alone: on this torch the package adds the plan (from 3 policy "
                     "entries instead of a hand-written plan), not speed")
    elif p is not None:
        lines.append(f"  -> the package's job receives {_bytes(p) / max(_bytes(a), 1):.2f}x torch alone's bytes")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", type=int_list, default=(2, 2),
                        help="mesh shape: 'tp' or 'dp,tp', e.g. 4 or 2,2 (default 2,2)")
    parser.add_argument("--steps", type=positive_int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--layers", type=positive_int, default=2, help="transformer layers (default 2)")
    parser.add_argument("--dense", action="store_true", help="dense SwiGLU feed-forwards instead of experts")
    parser.add_argument("--planner", action="store_true",
                        help="run DTensor's redistributions through the package's planner (off by default, as in "
                        "the package)")
    parser.add_argument("--compile", action="store_true",
                        help="run the applied plan under torch.compile on gloo ranks (started here unless torchrun "
                        "did) and report graphs, graph breaks and the collectives the profiler saw")
    parser.add_argument("--backend", choices=("aot_eager", "inductor"), default="aot_eager",
                        help="torch.compile backend with --compile (default aot_eager)")
    parser.add_argument("--no-package", action="store_true",
                        help="run torch alone (the package uninstalled, torchtitan's plan); exit status 1 if it fails")
    parser.add_argument("--svg", type=output_file, default=Path("dtensor_ext_demo.svg"),
                        help="where to write the picture (default dtensor_ext_demo.svg; its directory must exist)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's weights and the batches (default 0)")


def run(args: argparse.Namespace) -> int:
    """Exit status 0 when the job ran every step and matched one device, 1 otherwise, 2 for a usage error."""
    usage_error = getattr(args, "parser", argparse.ArgumentParser(prog="python -m dtensor_ext demo")).error
    try:
        check_mesh(args.mesh, demo_config(args.dense, args.layers))
    except ValueError as e:
        usage_error(f"argument --mesh: {e}")
    if args.compile:
        if args.no_package or args.planner:
            usage_error("argument --compile: runs the package's plan alone (not with --no-package or --planner)")
        from dtensor_ext.tools.compiled_demo import run_compiled

        return run_compiled(tuple(args.mesh), args.steps, args.dense, args.layers, args.seed, args.backend)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    real_ranks = world > 1
    if real_ranks:
        if math.prod(args.mesh) != world:
            usage_error(f"argument --mesh: {math.prod(args.mesh)} ranks, but torchrun started {world}")
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
    rank0 = not real_ranks or dist.get_rank() == 0
    try:
        report = run_demo(args.mesh, steps=args.steps, dense=args.dense, layers=args.layers,
                          with_package=not args.no_package, seed=args.seed, svg=args.svg if rank0 else None,
                          progress=_print_progress if rank0 else (lambda *a: None), real_ranks=real_ranks,
                          planner=args.planner)
    finally:
        if real_ranks:
            dist.destroy_process_group()
    ok = _matches(report.package)
    if rank0:
        print(format_report(report))
        print("OK: matches one device" if ok else "FAILED: the job did not run every step" if report.package.failure
              else "MISMATCH against one device")
    return 0 if ok else 1
