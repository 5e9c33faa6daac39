"""Each traced op's candidate shardings, found by DTensor itself.

For one mesh dim at a time, every op is run on fake DTensors (no data, no communication) once for each
combination of its inputs' placements on that dim (Replicate, Partial, Shard on each dim that divides evenly).
A combination is a candidate when DTensor runs the op, forward and backward, without any collective: then its
sharding propagation (torch's strategies plus this package's rules) accepted those input placements as they are,
and the output placements it produced are what the op will produce when the plan runs. Everything that moves data
is then a redistribution between one op's output and the next op's input, which the solver prices.

Results are cached by the op and its input shapes and arguments, so repeated layers are enumerated once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.flop_counter import FlopCounterMode

from dtensor_ext._compat import (clear_sharding_caches, fake_tensor_mode, outside_dispatch_modes,
                                 outside_simulated_ranks, quiet_torch_log, redistribution_plans_kept,
                                 strided_offsets_on_plain_ints)
from dtensor_ext.policy.trace import OpNode, op_outputs, replace_tensors, tensors_in, unique_tensors

__all__ = ["Candidate", "CandidateCache", "NodeOptions", "enumerate_candidates", "enumerated", "local_shape",
           "operand_tensors", "prove_combinations", "splits"]

# Beyond this many input combinations, only those with at most two non-replicated inputs, plus the ones that shard
# every input of the same rank alike, are tried (attention's q, k, v by heads).
MAX_COMBINATIONS = 160


@dataclass(frozen=True)
class Candidate:
    """One way DTensor runs the op without communicating: per operand and output, its placements (one per mesh
    dim: on one mesh dim's candidates a 1-tuple, on the whole mesh's one entry per dim)."""

    inputs: tuple  # placements of each operand (graph order: node.operand_ids)
    outputs: tuple  # placements of each tensor output
    grads: tuple  # placements of each operand's gradient (None: no gradient)
    shards: int  # the pieces the op's work is split into: the product of the ranks of the dims it shards on
    saved: int = 0  # bytes a rank holds for backward (autograd's saved tensors, parameters aside)
    # per operand: the bytes of it a rank saves for backward where it is a parameter (the parameter itself, no
    # cost, unless the plan moves it first: then the moved copy is held)
    param_saved: tuple = ()
    # False: a combination of proven per-dim candidates, its placements and bytes predicted from theirs; it is
    # proven (CandidateCache.prove) before a plan may use it
    proven: bool = True

    @property
    def replicated(self) -> bool:
        return all(p.is_replicate() for placements in self.inputs for p in placements)


@dataclass
class NodeOptions:
    """A node's candidates on one mesh dim (or on the whole mesh), and the work it does on one device (flops,
    bytes touched)."""

    candidates: list[Candidate]
    flops: int
    nbytes: int
    tried: dict  # input placements -> why they were refused (a collective DTensor needed, or its error)
    saved: int = 0  # bytes autograd saves for backward when the op runs on one device (parameters aside)


def operand_tensors(node: OpNode) -> list[torch.Tensor]:
    """The traced tensors an op read, in the order of node.operand_ids (each object once)."""
    return unique_tensors((node.args, node.kwargs))


def _key_of(value):
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_key_of(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _key_of(v)) for k, v in value.items()))
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device, slice, type(Ellipsis))):
        return repr(value)
    raise _Uncacheable  # an argument whose value a key cannot capture: enumerate the op for itself


class _Uncacheable(Exception):
    pass


def _placements(t: torch.Tensor, size: int, is_param: bool) -> list:
    options = [Replicate()]
    if t.is_floating_point() and not is_param and t.ndim > 0:
        options.append(Partial())
    options += [Shard(d) for d in range(t.ndim) if t.shape[d] >= size and t.shape[d] % size == 0]
    return options


def _combinations(options: list[list]) -> list[tuple]:
    every = list(itertools.product(*options))
    if len(every) <= MAX_COMBINATIONS:
        return every
    return list(dict.fromkeys([c for c in every if _few(c)] + [c for c in every if _alike(c)]))


def _few(combo: tuple) -> bool:
    return sum(not p.is_replicate() for p in combo) <= 2


def _alike(combo: tuple) -> bool:
    return len({p for p in combo if not p.is_replicate()}) == 1 and all(p.is_shard() for p in combo
                                                                          if not p.is_replicate())


def enumerated(node: OpNode, size: int, param_operands: frozenset[int], combo: tuple) -> bool:
    """Whether `enumerate_candidates` tries the input placements `combo` (one per operand) on a mesh dim of
    `size` ranks: without running the op, for a plan read back (policy.pinned)."""
    options = [_placements(t, size, k in param_operands) for k, t in enumerate(operand_tensors(node))]
    return len(combo) == len(options) and all(p in o for p, o in zip(combo, options)) and (
        math.prod(map(len, options)) <= MAX_COMBINATIONS or _few(combo) or _alike(combo))


# Candidates depend on the op, its inputs' shapes and arguments and the mesh (dim) sizes only: kept for the process.
_FOUND: dict[tuple, object] = {}


class CandidateCache:
    """Candidates per op, input shapes and arguments: each repeated layer is enumerated (and each of its
    combinations proven) once, and again never in this process."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.cache = _FOUND
        self.one_dim: dict[int, tuple[DeviceMesh, int]] = {}  # each mesh dim's 1-D mesh, made once (not per op)

    def options(self, node: OpNode, mesh_dim: int, param_operands: frozenset[int],
                grad_operands: frozenset[int]) -> NodeOptions:
        """One mesh dim's candidates (Replicate on the other dims), as 1-tuples. Mesh dims of the same size
        share them: they are found on the first of them."""
        size = self.mesh.size(mesh_dim)
        first = next(d for d in range(self.mesh.ndim) if self.mesh.size(d) == size)
        key = self._key("dim", size, node, param_operands, grad_operands)
        if key is None or key not in self.cache:
            found = enumerate_candidates(node, *self._one_dim(first), param_operands, grad_operands)
            if key is None:
                return found
            self.cache[key] = found
        return self.cache[key]

    def combined(self, node: OpNode, per_dim: list[list[Candidate]], param_operands: frozenset[int],
                 grad_operands: frozenset[int], saved: int) -> list[Candidate]:
        """The whole mesh's candidates: every combination of one candidate per mesh dim (`per_dim[m]`, as
        `options` found and the constraints kept them) that DTensor has not refused on the whole mesh. A
        combination already proven comes with the placements DTensor produced there; one not yet proven is
        predicted from its parts (`proven=False`: each dim's placements as found on that dim, its work split by
        every dim that splits it, its saved bytes `saved` (one device's) times each dim's share). On a 1-D mesh a
        dim's candidates were found on the whole mesh: they are the answer as they are."""
        if self.mesh.ndim == 1:
            return list(per_dim[0])
        found = []
        operand_bytes = [t.numel() * t.element_size() for t in operand_tensors(node)]
        for picked in itertools.product(*per_dim):
            combo = tuple(tuple(c.inputs[k][0] for c in picked) for k in range(len(picked[0].inputs)))
            known = self.cache.get(self._proof_key(node, combo, param_operands, grad_operands))
            if isinstance(known, Candidate):
                found.append(known)
            elif known is None:
                found.append(_predicted(picked, combo, saved, operand_bytes))
        return found

    def prove(self, node: OpNode, candidate: Candidate, param_operands: frozenset[int],
              grad_operands: frozenset[int]) -> Candidate | str:
        """One fake run of `candidate`'s input placements on the whole mesh: the Candidate DTensor runs it as
        (forward and backward without communicating), or why it is refused. Kept for the process."""
        key = self._proof_key(node, candidate.inputs, param_operands, grad_operands)
        if key is None or key not in self.cache:
            found = prove_combinations(node, self.mesh, [candidate.inputs], param_operands, grad_operands)[0]
            if key is None:
                return found
            self.cache[key] = found
        return self.cache[key]

    def prove_all(self, node: OpNode, candidates: list[Candidate], param_operands: frozenset[int],
                  grad_operands: frozenset[int]) -> list[Candidate | str]:
        """`prove` for each of `candidates` (a proven one stands as it is), the combinations this process has not
        proven yet run in one batch of fake runs (one fake copy of the operands, DTensor's caches cleared once)."""
        keys = [None if c.proven else self._proof_key(node, c.inputs, param_operands, grad_operands)
                for c in candidates]
        missing = list(dict.fromkeys(c.inputs for c, key in zip(candidates, keys)
                                     if not c.proven and (key is None or key not in self.cache)))
        ran = dict(zip(missing, prove_combinations(node, self.mesh, missing, param_operands, grad_operands)
                       if missing else ()))
        found = []
        for c, key in zip(candidates, keys):
            if c.proven:
                found.append(c)
                continue
            if key is not None and key not in self.cache:
                self.cache[key] = ran[c.inputs]
            found.append(ran[c.inputs] if key is None else self.cache[key])
        return found

    def _proof_key(self, node: OpNode, combo: tuple, param_operands, grad_operands) -> tuple | None:
        return self._key(("mesh", tuple(self.mesh.shape), combo), 0, node, param_operands, grad_operands)

    @staticmethod
    def _key(kind, size: int, node: OpNode, param_operands, grad_operands) -> tuple | None:
        try:
            return (kind, size, node.fn, _key_of(node.args), _key_of(node.kwargs), param_operands, grad_operands)
        except _Uncacheable:
            return None

    def _one_dim(self, mesh_dim: int) -> tuple[DeviceMesh, int]:
        """The 1-D mesh of a named mesh dim (DTensor propagates on it several times faster than on the whole
        mesh with Replicate elsewhere, with the same candidates); the whole mesh where dims have no names."""
        names = self.mesh.mesh_dim_names
        if self.mesh.ndim == 1 or not names:
            return self.mesh, mesh_dim
        if mesh_dim not in self.one_dim:
            with outside_simulated_ranks():
                self.one_dim[mesh_dim] = self.mesh[names[mesh_dim]], 0
        return self.one_dim[mesh_dim]


def enumerate_candidates(node: OpNode, mesh: DeviceMesh, mesh_dim: int, param_operands: frozenset[int],
                         grad_operands: frozenset[int]) -> NodeOptions:
    """Run `node` on fake DTensors for every combination of input placements on `mesh_dim` (Replicate on the
    other dims) and keep those DTensor runs forward and backward without communicating, as 1-tuples of their
    placements on `mesh_dim`. Only the operands in `grad_operands` (those the training step differentiates) get
    gradients: a mask or a rotary table has none, so the partial gradient DTensor would make for it is no cost."""
    size = mesh.size(mesh_dim)
    operands = operand_tensors(node)
    options = [_placements(t, size, k in param_operands) for k, t in enumerate(operands)]
    candidates, tried = [], {}
    with _fake_runs(operands) as fakes:
        flops, nbytes, saved = _work(node, operands, fakes, grad_operands, param_operands)
        for combo in _combinations(options):
            whole = tuple(_sharded(mesh, mesh_dim, p) for p in combo)
            found = _try(node, mesh, operands, fakes, whole, grad_operands, param_operands)
            if isinstance(found, Candidate):
                candidates.append(_on_dim(found, mesh_dim))
            else:
                tried[tuple((p,) for p in combo)] = found
    return NodeOptions(candidates, flops, nbytes, tried, saved)


def prove_combinations(node: OpNode, mesh: DeviceMesh, combos: list[tuple], param_operands: frozenset[int],
                       grad_operands: frozenset[int]) -> list[Candidate | str]:
    """For each combination of input placements on the whole mesh (one tuple per operand), the Candidate DTensor
    runs it as, or why it is refused."""
    operands = operand_tensors(node)
    with _fake_runs(operands) as fakes:
        return [_try(node, mesh, operands, fakes, combo, grad_operands, param_operands) for combo in combos]


@contextlib.contextmanager
def _fake_runs(operands):
    """Fake copies of the operands, outside the simulated ranks and any dispatch mode; DTensor's sharding caches
    are cleared afterwards: its cached strategies hold stateful placements (an embedding's _MaskPartial keeps the
    mask it made), and the fake runs' fake masks would meet the real run of the same op. A trace made on fake
    tensors (a model on the meta device) is run in its own fake mode. A strided shard's offsets
    (two mesh dims sharding tensor dims that a view flattens together) are worked out on plain ints, as a real run
    does: fake tensors cannot hold them. DTensor's redistribution plans (which price every strategy it weighs) are
    kept across runs, as a real run keeps them, not planned again for each op of each run."""
    with (outside_simulated_ranks(), outside_dispatch_modes(), _quiet_fake_kernels(), strided_offsets_on_plain_ints(),
          redistribution_plans_kept(), fake_tensor_mode(like=operands) as fake):
        try:
            yield [fake.from_tensor(t) for t in operands]
        finally:
            clear_sharding_caches()


def _predicted(picked: tuple[Candidate, ...], combo: tuple, saved: int, operand_bytes: list[int]) -> Candidate:
    """A combination of per-dim candidates as their parts predict it (not proven)."""
    def joined(field):
        return tuple(None if any(getattr(c, field)[k] is None for c in picked) else
                     tuple(getattr(c, field)[k][0] for c in picked) for k in range(len(getattr(picked[0], field))))
    share = math.prod(c.saved / saved for c in picked) if saved else 0.0
    # a parameter an op saves: each dim's shard of it as that dim's share of the whole, as for `saved`
    param_saved = tuple(int(whole * math.prod(c.param_saved[k] / whole for c in picked)) if whole else 0
                        for k, whole in enumerate(operand_bytes)) if picked[0].param_saved else ()
    return Candidate(combo, joined("outputs"), joined("grads"), math.prod(c.shards for c in picked),
                     int(saved * share), param_saved, proven=False)


def _on_dim(c: Candidate, mesh_dim: int) -> Candidate:
    """A candidate found on a whole mesh with Replicate off `mesh_dim`, as that dim's 1-tuples."""
    def one(placements):
        return None if placements is None else (placements[mesh_dim],)
    return Candidate(tuple(map(one, c.inputs)), tuple(map(one, c.outputs)), tuple(map(one, c.grads)), c.shards,
                     c.saved, c.param_saved)


def _quiet_fake_kernels():
    """Fake tensors log every kernel that refuses to run; here a refusal only means "not a candidate"."""
    return quiet_torch_log("torch._subclasses.fake_tensor", logging.CRITICAL)


class _SavedBytes:
    """Counts the bytes per rank autograd saves for backward while an op runs (a DTensor by its shard), except
    the parameters themselves, which a rank holds anyway."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = {id(p) for p in params}
        self.total = 0
        self.of_params: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        local = t._local_tensor if isinstance(t, DTensor) else t
        param = id(t) if id(t) in self.params else id(t._base) if id(t._base) in self.params else None
        if param is None:
            self.total += local.numel() * local.element_size()
        else:  # a parameter, or a view of one
            self.of_params[param] = self.of_params.get(param, 0) + local.numel() * local.element_size()
        return t


def _inputs_for_autograd(values: list, grad_operands) -> list:
    """The operands as the op meets them in training: those backward reaches require gradients (non-leaf
    copies, so that in-place ops may write to them as they write to activations)."""
    return [v.requires_grad_().clone() if k in grad_operands and v.is_floating_point() else v
            for k, v in enumerate(values)]


def _work(node: OpNode, operands, fakes, grad_operands, param_operands) -> tuple[int, int, int]:
    """The op's flops and bytes touched on one device in a training step (its forward, and its backward where
    the step differentiates it), and the bytes autograd saves for its backward."""
    inputs = _inputs_for_autograd([f.detach() for f in fakes], grad_operands)
    table = {id(t): f for t, f in zip(operands, inputs)}
    counter = FlopCounterMode(display=False)
    saved = _SavedBytes([inputs[k] for k in param_operands])
    with torch.enable_grad(), counter:  # one block: entering the counter again would reset it
        try:
            with saved.hooks:
                out = node.fn(*replace_tensors(node.args, table), **replace_tensors(node.kwargs, table))
        except Exception:  # an op fake tensors cannot run is priced by its bytes alone
            out = ()
        touched = [*operands, *tensors_in(out)]
        touched += _backward_work(tensors_in(out), [inputs[k] for k in sorted(grad_operands) if k < len(inputs)])
    return counter.get_total_flops(), sum(t.numel() * t.element_size() for t in touched), saved.total


def _backward_work(outs: list[torch.Tensor], wanted: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the op's backward (its flops count where the caller counts): the gradients flowing in and out."""
    pairs = [(o, torch.ones_like(o)) for o in outs if o.requires_grad and o.is_floating_point()]
    wanted = [w for w in wanted if w.requires_grad]
    if not pairs or not wanted:
        return []
    try:
        grads = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    except Exception:  # a backward fake tensors cannot run is priced by its forward alone
        return []
    return [g for _, g in pairs] + [g for g in grads if g is not None]


def _sharded(mesh: DeviceMesh, mesh_dim: int, placement) -> tuple:
    return tuple(placement if d == mesh_dim else Replicate() for d in range(mesh.ndim))


def splits(p) -> bool:
    """The placement cuts a tensor dim into the ranks' pieces (Shard, and DTensor's strided shards)."""
    return not (p.is_replicate() or p.is_partial())


def local_shape(shape, mesh_shape, placements) -> list[int] | None:
    """A rank's shard shape under `placements` (one per mesh dim, applied in mesh-dim order); None where a split
    is uneven (every rank's shard would not be alike)."""
    shape = list(shape)
    for size, p in zip(mesh_shape, placements):
        if splits(p):
            if shape[p.dim] % size or shape[p.dim] < size:
                return None
            shape[p.dim] //= size
    return shape


def _as_dtensor(fake_global, mesh, placements):
    shape = local_shape(fake_global.shape, tuple(mesh.shape), placements)
    if shape is None:
        raise ValueError(f"{placements} split a dim of {list(fake_global.shape)} unevenly")
    local = torch.empty(shape, dtype=fake_global.dtype)
    return DTensor.from_local(local, mesh, list(placements), run_check=False, shape=fake_global.shape,
                              stride=fake_global.stride())


def _try(node: OpNode, mesh, operands, fakes, combo, grad_operands, param_operands) -> Candidate | str:
    """`combo`: each operand's placements on the whole of `mesh`."""
    try:
        dts = [_as_dtensor(f, mesh, p) for f, p in zip(fakes, combo)]
        with torch.enable_grad(), CommDebugMode() as comm:
            inputs = _inputs_for_autograd(dts, grad_operands)
            saved = _SavedBytes([inputs[k] for k in param_operands])
            args = replace_tensors(node.args, dict(zip(map(id, operands), inputs)))
            with saved.hooks:
                out = node.fn(*args, **replace_tensors(node.kwargs, dict(zip(map(id, operands), inputs))))
        if comm.get_total_counts():
            return f"DTensor communicates ({_counts(comm)})"
        outs = op_outputs(node.fn, args, out)
        if not all(isinstance(o, DTensor) for o in outs):
            return "the op returned a plain tensor"
        placements = tuple(tuple(o.placements) for o in outs)
        grads = _backward(outs, dts, mesh)
        if isinstance(grads, str):
            return grads
    except Exception as exc:  # DTensor refused these placements (or has no rule): not a candidate
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"
    shards = math.prod(mesh.size(m) for m in range(mesh.ndim)
                       if any(splits(p[m]) for p in (*combo, *placements)))
    param_saved = tuple(saved.of_params.get(id(t), 0) for t in inputs)
    return Candidate(tuple(map(tuple, combo)), placements, grads, shards, saved.total, param_saved)


def _backward(outs, dts, mesh):
    pairs = [(o, _as_dtensor(o, mesh, [Replicate() if p.is_partial() else p for p in o.placements]))
             for o in outs if o.requires_grad and o.is_floating_point()]
    wanted = [d for d in dts if d.requires_grad]
    if not pairs or not wanted:
        return tuple(None for _ in dts)
    with CommDebugMode() as comm:
        grads = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    if comm.get_total_counts():
        return f"DTensor's backward communicates ({_counts(comm)})"
    by_id = {id(d): g for d, g in zip(wanted, grads)}
    return tuple(tuple(by_id[id(d)].placements) if isinstance(by_id.get(id(d)), DTensor) else None for d in dts)


def _counts(comm: CommDebugMode) -> str:
    return ", ".join(f"{getattr(op, '__name__', op)} x{n}" for op, n in comm.get_comm_counts().items())
