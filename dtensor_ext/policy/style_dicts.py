"""torchtitan's ``{fqn: ParallelStyle}`` plans (what ``parallelize_module`` takes) read as constraints.

Keys are fqn globs from the root model (or, for a Hugging Face model, from its base model), each naming modules.
What a style fixes becomes ordinary constraints (``policy.scopes``), read from torch's styles:

- ``ColwiseParallel``: an ``nn.Linear``'s weight on dim 0 (its bias follows), an ``nn.Embedding``'s table on dim 1;
- ``RowwiseParallel``: an ``nn.Linear``'s weight on dim 1, an ``nn.Embedding``'s table on dim 0 (torch refuses both
  on other modules, and so is the entry);
- ``SequenceParallel(sequence_dim=d)``: the module's input on dim d;
- ``PrepareModuleInput`` (and the input half of ``PrepareModuleInputOutput``): each input, positional or keyword,
  whose desired layout is a ``Shard(d)``, on dim d.

Layouts where values are whole or reduced (``Replicate`` inputs, the outputs' layouts, ``PrepareModuleOutput``) are
the solve's to choose; a style entry that fixes no partition at all adds nothing. Any other ParallelStyle is refused.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from dtensor_ext.policy.constraints import Constraint
from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.scopes import input_shard_constraints, param_shard_constraints, resolve_path

__all__ = ["read_style_dict"]

# (style, module class) -> the dim its weight is sharded on (torch's _partition_linear_fn / _partition_embedding_fn)
_WEIGHT_DIM = {(ColwiseParallel, torch.nn.Linear): 0, (ColwiseParallel, torch.nn.Embedding): 1,
               (RowwiseParallel, torch.nn.Linear): 1, (RowwiseParallel, torch.nn.Embedding): 0}


def _inputs(style) -> list[tuple[int | str, int]]:
    """(positional index or keyword, dim) of each module input the style wants sharded."""
    if isinstance(style, SequenceParallel):
        return [(0, style.sequence_sharding[0].dim)]
    if isinstance(style, PrepareModuleInputOutput):
        style = style.prepare_module_input
    if not isinstance(style, PrepareModuleInput):
        return []
    wanted = list(enumerate(style.desired_input_layouts or ())) + list(style.desired_input_kwarg_layouts.items())
    return [(where, p.dim) for where, p in wanted if isinstance(p, Shard)]


def read_style_dict(plan: dict, graph, mesh, warn_unused: bool = False) -> list[Constraint]:
    """The constraints a ``{fqn: ParallelStyle}`` dict states for the traced model (module docstring)."""
    model = graph.model
    found: list[Constraint] = []
    known = (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput,
             PrepareModuleInputOutput)
    for key, style in plan.items():
        where = f"style dict[{key!r}] = {type(style).__name__}"
        if type(style) not in known:
            raise PolicyError(where, "<style>", type(style).__name__,
                              f"one of torch's ParallelStyles {', '.join(k.__name__ for k in known)}")
        match = resolve_path(model, key, where, warn_unused)
        if match is None:
            continue
        if not match.modules:
            raise PolicyError(where, "<key>", key, f"an fqn glob naming modules (it names parameters: "
                                                   f"{', '.join(match.params[:3])})")
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            dims = {}
            for fqn in match.modules:
                module = model.get_submodule(fqn)
                kind = next((k for k in (torch.nn.Linear, torch.nn.Embedding) if isinstance(module, k)), None)
                if kind is None:
                    raise PolicyError(where, "<key>", fqn, f"an nn.Linear or nn.Embedding: torch's "
                                                           f"{type(style).__name__} shards only those (got "
                                                           f"{type(module).__name__})")
                dims[f"{fqn}.weight"] = _WEIGHT_DIM[(type(style), kind)]
            found += param_shard_constraints(graph, where, f"{match.glob}.weight", list(dims), dims, None)
        for position, dim in _inputs(style):
            found += input_shard_constraints(graph, where, match.glob, match.modules, position, dim, None)
    return found
