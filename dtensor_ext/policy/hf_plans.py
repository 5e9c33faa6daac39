"""Hugging Face's tensor and expert parallel plans read as constraints.

transformers 5.x ships plans with its models: ``config.base_model_tp_plan`` maps fqn globs relative to the base model
(``layers.*.self_attn.q_proj``) to style names, the causal-LM class adds ``_tp_plan = {'lm_head':
'colwise_gather_output'}``, the model adds ``embed_tokens: embedding_rowwise``, and MoE configs have a
``base_model_ep_plan``. ``model_plans(model)`` gathers them as the model holds them (``model.tp_plan``, with
``ep=True`` also ``model.ep_plan``, dropping the TP entries on expert modules as transformers does);
``build_plan(..., constraints=model_plans(model))`` or ``constraints=model.config.base_model_tp_plan`` reads them.

A key names a module (its style applies to the module's own parameters, as transformers expands it) or a parameter
(its style wins over its module's). What each style fixes, read from transformers 5.23's styles
(``transformers/distributed/tensor_parallel.py``, ``expert_parallel.py``), becomes ordinary constraints
(``policy.scopes``): every op reading a sharded parameter reads it on that dim of the mesh dim (``tp``, or ``ep`` for
the EP plan where the mesh names one), never replicated. For a module entry the weight (its parameter of most dims)
is constrained and a bias follows from DTensor's rule for the op. The styles' layouts where values are whole (a
replicated input, a gathered or all-reduced output) are left to the solve:

- ``colwise``, ``colwise_rep``, ``colwise_gather_output``: ``Shard(ndim - 2)`` (a linear's weight and bias on dim 0);
- ``rowwise``, ``rowwise_rep``, ``rowwise_split_input``: weight ``Shard(-1)``, bias replicated;
- ``embedding_rowwise``, ``embedding_colwise``: the embedding table on dim 0 (vocabulary) or 1;
- ``grouped_gemm`` (EP): experts' weights on dim 0, the expert dim;
- ``sequence_parallel``: the module's input on dim 1 (the sequence), its parameters replicated;
- ``packed_colwise``, ``packed_rowwise``: a 1-D parameter on dim 0 or replicated; a packed weight is a strided shard
  (gate and up halves each split), which a constraint (``Shard(dim)``) cannot state: refused, naming the entry;
- no partition of their own (the communication they add by hand to local tensors is what DTensor derives from the
  placements): ``replicate``, ``replicated_with_grad_allreduce``, ``local_params``, ``moe_tp_experts``,
  ``moe_identity_expert``, ``all_reduce``, ``mla_kv_a_proj``, ``ep_dispatch_experts``.

Any other name is refused, naming the style.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtensor_ext.policy.constraints import Constraint
from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.scopes import input_shard_constraints, param_shard_constraints, resolve_path

__all__ = ["HFPlan", "NO_PARTITION", "STYLES", "model_plans", "read_hf_plan"]

_COLWISE = ("colwise", "colwise_rep", "colwise_gather_output")
_ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input")
# styles that state no partition: what transformers does by hand on local tensors, DTensor derives from placements
NO_PARTITION = ("replicate", "replicated_with_grad_allreduce", "local_params", "moe_tp_experts",
                "moe_identity_expert", "all_reduce", "mla_kv_a_proj", "ep_dispatch_experts")
STYLES = (*_COLWISE, *_ROWWISE, "embedding_rowwise", "embedding_colwise", "grouped_gemm", "sequence_parallel",
          "packed_colwise", "packed_rowwise", *NO_PARTITION)


@dataclass(frozen=True)
class HFPlan:
    """A model's Hugging Face plans: ``tp`` and ``ep`` map fqn globs (from the model or its base model) to style
    names; ``origin`` names them in errors."""

    tp: dict[str, str]
    ep: dict[str, str] = field(default_factory=dict)
    origin: str = ""


def model_plans(model, *, ep: bool = False) -> HFPlan:
    """The plans a Hugging Face model applies with ``from_pretrained(tp_plan="auto")``: ``model.tp_plan`` (the
    class's ``_tp_plan``, ``config.base_model_tp_plan`` under the base model, the input embedding vocabulary-sharded);
    with ``ep`` also ``model.ep_plan`` (``config.base_model_ep_plan``), whose modules then take no TP entry. Entries
    that name nothing in the model are left out with a warning, as transformers leaves them out."""
    name = type(model).__name__
    tp = getattr(model, "tp_plan", None)
    if not isinstance(tp, dict) or not tp:
        raise PolicyError("model_plans", "model", name, "a Hugging Face model with a tensor parallel plan "
                                                        "(transformers 5.x: config.base_model_tp_plan)")
    experts = dict(getattr(model, "ep_plan", None) or {}) if ep else {}
    if ep and not experts:
        raise PolicyError("model_plans", "ep", True, f"a model with an expert parallel plan ({name}'s config has "
                                                     f"no base_model_ep_plan)")
    tp = {key: style for key, style in tp.items()
          if not any(key == e or key.startswith(f"{e}.") for e in experts)}
    # as transformers does, entries naming nothing in this model (a dense MLP's in an all-MoE Qwen3-MoE) are
    # dropped with a warning
    kept = {kind: {key: style for key, style in plan.items()
                   if resolve_path(model, key, f"{name} {kind}[{key!r}] = {style!r}", warn_unused=True)}
            for kind, plan in (("tp_plan", tp), ("ep_plan", experts))}
    return HFPlan(kept["tp_plan"], kept["ep_plan"], name)


def _dim(style: str, name: str, ndim: int, where: str) -> int | None:
    """The dim ``style`` shards a parameter named ``name`` of ``ndim`` dims on; None: it stays whole."""
    if style in _COLWISE:
        return (ndim - 2) % ndim
    if style in _ROWWISE:
        return None if name == "bias" else ndim - 1
    if style in ("embedding_rowwise", "grouped_gemm"):
        return 0
    if style == "embedding_colwise":
        return 1
    if style in ("packed_colwise", "packed_rowwise") and ndim > 1:
        raise PolicyError(where, "<style>", style,
                          f"a style whose partition is a Shard: {style} splits the packed halves of {name} each "
                          f"(_StridedShard(dim={ndim - 2 if style == 'packed_colwise' else ndim - 1}, "
                          f"split_factor=2)), which a constraint cannot state; give the halves' module a "
                          f"constraint of its own or leave the entry out")
    if style == "packed_colwise":
        return 0
    return None


def read_hf_plan(plan: HFPlan, graph, mesh, warn_unused: bool = False) -> list[Constraint]:
    """The constraints ``plan`` states for the traced model (module docstring)."""
    model = graph.model
    names = tuple(mesh.mesh_dim_names or ())
    found: list[Constraint] = []
    # parameter -> (entry, scope glob, dim, mesh dim, named by its own key); a parameter's own key wins
    chosen: dict[str, tuple[str, str, int | None, str | None, bool]] = {}
    for kind, entries in (("tp_plan", plan.tp), ("ep_plan", plan.ep)):
        if not isinstance(entries, dict):
            raise PolicyError(f"{plan.origin} {kind}".strip(), "<plan>", entries, "a dict {fqn glob: style name}")
        mesh_dim = "ep" if kind == "ep_plan" and "ep" in names else None
        for key, style in entries.items():
            where = f"{plan.origin} {kind}[{key!r}] = {style!r}".strip()
            if style not in STYLES:
                raise PolicyError(where, "<style>", style, f"a transformers 5.x style name: {', '.join(STYLES)}")
            match = resolve_path(model, key, where, warn_unused)
            if match is None:
                continue
            if style == "sequence_parallel":
                found += input_shard_constraints(graph, where, match.glob, match.modules, 0, 1, mesh_dim)
            for fqn in match.params:
                value = model.get_parameter(fqn)
                chosen[fqn] = (where, match.glob, _dim(style, fqn.rsplit(".", 1)[-1], value.ndim, where), mesh_dim,
                               True)
            for module_fqn in match.modules:
                own = list(model.get_submodule(module_fqn).named_parameters(recurse=False))
                most = max((p.ndim for _, p in own), default=0)
                for name, value in own:
                    fqn = f"{module_fqn}.{name}"
                    dim = _dim(style, name, value.ndim, where)
                    if not chosen.get(fqn, (None,) * 5)[4] and (dim is None or value.ndim == most):
                        chosen[fqn] = (where, f"{match.glob}.{name}", dim, mesh_dim, False)
    groups: dict[tuple, dict[str, int]] = {}
    for fqn, (where, scope, dim, mesh_dim, _) in chosen.items():
        if dim is not None:
            groups.setdefault((where, scope, mesh_dim), {})[fqn] = dim
    for (where, scope, mesh_dim), dims in groups.items():
        found += param_shard_constraints(graph, where, scope, list(dims), dims, mesh_dim)
    return found
