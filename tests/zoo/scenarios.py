"""Model-zoo scenarios as data: which parameter goes where, how a batch is laid out, how a run is judged.

Every scenario trains one step of a tiny Hugging Face model (dtensor_ext.testing.hf_zoo) and returns its loss and
every parameter's gradient as plain tensors, so one comparison against the one-device run judges them all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dtensor_ext.testing.hf_zoo import sample_batch, tiny_model

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

    def build(self):
        return tiny_model(self.model, attn_implementation=self.attention, dtype=self.dtype)

    def inputs(self) -> dict[str, torch.Tensor]:
        """Token ids, padded labels, positions, and for eager attention a 4-D additive causal mask (HF takes a 4-D
        mask as given; the one it builds itself is a plain tensor, which cannot meet DTensor activations)."""
        input_ids, labels = sample_batch(self.batch, self.seq)
        inputs = {"input_ids": input_ids, "labels": labels, "position_ids": torch.arange(self.seq).repeat(self.batch, 1)}
        if self.attention == "eager":
            blocked = torch.ones(self.seq, self.seq, dtype=torch.bool).triu(1)
            mask = torch.zeros(self.seq, self.seq, dtype=self.dtype).masked_fill(blocked, torch.finfo(self.dtype).min)
            inputs["attention_mask"] = mask.expand(self.batch, 1, self.seq, self.seq).contiguous()
        return inputs


def gradients(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}


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


def all_dtensor(step: Step, mesh) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The step with every activation a DTensor: the batch on the first mesh dim, TP_PLAN on the last."""
    model = step.build()
    distribute_everything(model, mesh)
    batch_layout = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    inputs = {k: distribute_tensor(v, mesh, batch_layout) for k, v in step.inputs().items()}
    loss = model(**inputs, use_cache=False).loss
    loss.backward()
    return loss.full_tensor().detach(), gradients(model)


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
