"""Model-zoo scenarios as data: which parameter goes where, how a batch is laid out, how a run is judged.

Every scenario trains one step of a tiny Hugging Face model (dtensor_ext.testing.hf_zoo) and returns its loss and
every parameter's gradient as plain tensors, so one comparison against the one-device run judges them all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel, parallelize_module,
)

from dtensor_ext import _compat
from dtensor_ext.testing.hf_zoo import MOE, sample_batch, tiny_model

# Tensor parallelism of every zoo model, torchtitan-style: parameter-name pattern -> placement on the tp mesh dim.
TP_PLAN = {
    r"embed_tokens\.weight$": Shard(0),  # vocab-parallel embedding (its output is _MaskPartial)
    r"\.(q|k|v|gate|up)_proj\.(weight|bias)$": Shard(0),  # column-parallel: heads / intermediate features
    r"\.(o|down)_proj\.weight$": Shard(1),  # row-parallel
    r"experts\.gate_up_proj$": Shard(1),  # experts tensor-parallel on their intermediate features
    r"experts\.down_proj$": Shard(2),
    r"lm_head\.weight$": Shard(0),  # vocab-parallel logits
}


def tp_placement(name: str):
    placements = [p for pattern, p in TP_PLAN.items() if re.search(pattern, name)]
    return placements[0] if placements else Replicate()


@dataclass(frozen=True)
class Step:
    """What one training step sees: the model family, HF's attention kernel, the batch size, the dtype."""

    model: str
    attention: str = "sdpa"
    batch: int = 4
    seq: int = 16
    dtype: torch.dtype = torch.float32
    # a 4-D causal mask built here: eager attention needs one; so does compiled code under sequence parallelism,
    # where HF would build it from the sequence-sharded activation's length
    explicit_mask: bool = False

    def build(self):
        return tiny_model(self.model, attn_implementation=self.attention, dtype=self.dtype)

    def inputs(self) -> dict[str, torch.Tensor]:
        """Token ids, padded labels, positions, and for eager attention a 4-D additive causal mask (HF takes a 4-D
        mask as given; the one it builds itself is a plain tensor, which cannot meet DTensor activations)."""
        input_ids, labels = sample_batch(self.batch, self.seq)
        positions = torch.arange(self.seq).repeat(self.batch, 1)
        inputs = {"input_ids": input_ids, "labels": labels, "position_ids": positions}
        if self.attention == "eager" or self.explicit_mask:
            blocked = torch.ones(self.seq, self.seq, dtype=torch.bool).triu(1)
            mask = torch.zeros(self.seq, self.seq, dtype=self.dtype).masked_fill(blocked, torch.finfo(self.dtype).min)
            inputs["attention_mask"] = mask.expand(self.batch, 1, self.seq, self.seq).contiguous()
        return inputs


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `t`: the gathered DTensor, or a simulated mesh's per-rank value (all ranks must agree)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    values = _compat.local_tensor_values(t)
    if values is None:
        return t
    first = values[min(values)]
    assert all(torch.equal(v, first) for v in values.values()), f"ranks disagree on a replicated value: {values}"
    return first


def gradients(model) -> dict[str, torch.Tensor]:
    return {n: _plain(p.grad) for n, p in model.named_parameters()}


def one_device(step: Step) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = step.build()
    loss = model(**step.inputs(), use_cache=False).loss
    loss.backward()
    return loss.detach(), gradients(model)


def distribute_everything(model, mesh) -> None:
    """Every parameter and buffer a DTensor: Replicate on the data-parallel dims, TP_PLAN on the last (tp) dim."""
    data_parallel = [Replicate()] * (mesh.ndim - 1)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            qualified = next(n for n, p in model.named_parameters() if p is param)
            placed = distribute_tensor(param.data, mesh, [*data_parallel, tp_placement(qualified)])
            module.register_parameter(name, torch.nn.Parameter(placed))
        for name, buffer in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, distribute_tensor(buffer, mesh, [Replicate()] * mesh.ndim), persistent=False)


def all_dtensor(model, inputs: dict, mesh) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step with every activation a DTensor: the batch on the first mesh dim, TP_PLAN on the last. Build
    `model` and `inputs` (Step.build, Step.inputs) before entering a simulated mesh."""
    distribute_everything(model, mesh)
    batch_layout = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    inputs = {k: distribute_tensor(v, mesh, batch_layout) for k, v in inputs.items()}
    loss = model(**inputs, use_cache=False).loss
    loss.backward()
    return _plain(loss).detach(), gradients(model)


# 1-D tensor (+ sequence) parallelism through parallelize_module, torchtitan-style; module path -> style. Experts
# stay whole on every rank (their MoE block gets the whole sequence and hands back this rank's part).
_LAYER = "model.layers.*."
TP_STYLES = {
    "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
    **{f"{_LAYER}self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
    f"{_LAYER}self_attn.o_proj": RowwiseParallel(),
    **{f"{_LAYER}mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")},
    f"{_LAYER}mlp.down_proj": RowwiseParallel(),
    "lm_head": ColwiseParallel(output_layouts=Replicate()),
}
_TOKENS_WHOLE = dict(desired_input_layouts=(Replicate(),), use_local_output=True)
SP_STYLES = {  # on top of TP_STYLES: norms and the residual stream sharded along the sequence
    "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    f"{_LAYER}input_layernorm": SequenceParallel(),
    f"{_LAYER}post_attention_layernorm": SequenceParallel(),
    f"{_LAYER}self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                             desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                             use_local_output=True),
    f"{_LAYER}self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
    f"{_LAYER}mlp": PrepareModuleInput(input_layouts=(Shard(1),), **_TOKENS_WHOLE),
    f"{_LAYER}mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    "model.norm": SequenceParallel(),
    "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
}
_MOE_SP = {f"{_LAYER}mlp": [PrepareModuleInput(input_layouts=(Shard(1),), **_TOKENS_WHOLE),
                            PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),))]}


# Qwen3's per-head q/k norms see only this rank's heads: as DTensors sharded on heads (dim 2 of (b, s, h, d)) their
# weight gradients are summed over the ranks, as plain tensors each rank would keep its own part.
_HEAD_NORMS = {f"{_LAYER}self_attn.{n}_norm": SequenceParallel(sequence_dim=2, use_local_output=True) for n in "qk"}


def parallel_plan(model, *, sequence_parallel: bool) -> dict:
    plan = {**TP_STYLES, **(SP_STYLES if sequence_parallel else {})}
    if hasattr(model.model.layers[0].self_attn, "q_norm"):
        plan.update(_HEAD_NORMS)
    if model.config.model_type in MOE and sequence_parallel:
        plan.update(_MOE_SP)
    return plan


def tensor_parallel(model, inputs: dict, mesh, *, sequence_parallel: bool = False, compile: bool = False):
    """One step with parallelize_module's 1-D TP (+SP) plan; activations between modules are plain tensors."""
    for path, styles in parallel_plan(model, sequence_parallel=sequence_parallel).items():
        for style in styles if isinstance(styles, list) else [styles]:
            parallelize_module(model, mesh, {path: style})
    forward = torch.compile(model, backend="aot_eager") if compile else model
    loss = forward(**inputs, use_cache=False).loss
    loss.backward()
    return _plain(loss).detach(), gradients(model)


def mismatches(run, expected, *, atol: float = 1e-5, rtol: float = 1e-4) -> list[str]:
    """Names of what differs between two (loss, gradients) results: 'loss' and parameter names."""
    (loss, grads), (want_loss, want_grads) = run, expected
    wrong = [] if torch.allclose(loss.float(), want_loss.float(), atol=atol, rtol=rtol) else ["loss"]
    return wrong + [n for n, g in want_grads.items() if not torch.allclose(grads[n].float(), g.float(), atol=atol,
                                                                            rtol=rtol)]


def outcome(run, expected, **tolerances) -> str:
    """'ok', 'wrong' (some value differs) or 'fails' for a scenario run as a thunk."""
    try:
        result = run()
    except (RuntimeError, NotImplementedError, AssertionError, ValueError):
        return "fails"
    return "wrong" if mismatches(result, expected, **tolerances) else "ok"
