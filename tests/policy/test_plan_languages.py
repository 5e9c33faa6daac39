"""The plans users already write, read as constraints: fqn-scoped YAML (`module:`), Hugging Face's own tp/ep plans
and torchtitan's {fqn: ParallelStyle} dicts. Each plan runs and equals one device, with the weights sharded as the
plan says; what cannot be stated or run is one PolicyError naming the entry."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, PrepareModuleOutput

from dtensor_ext.models.llama import LlamaConfig, TinyLlama, torchtitan_plan
from dtensor_ext.models.policy_files import policy_text
from dtensor_ext.policy import Constraint, PolicyError, build_plan, get_pas_ops
from dtensor_ext.policy.constraints import parse_constraints
from dtensor_ext.policy.hf_plans import STYLES, HFPlan, model_plans
from dtensor_ext.policy.scopes import as_constraints
from dtensor_ext.policy.trace import trace_graph
from dtensor_ext.testing import simulated_mesh
from tests.policy.checks import assert_applied_plan_matches
from tests.policy.test_hf_zoo import compare

hf_zoo = pytest.importorskip("dtensor_ext.testing.hf_zoo")

COLUMN_ROW = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")


def test_yaml_module_glob_is_parsed_and_checked():
    (c,) = parse_constraints('- name: torch.nn.functional.linear\n  module: "model.layers.*.self_attn.o_proj"\n'
                             '  allowed_partition_dims: ["1,1"]\n')
    assert c == Constraint("torch.nn.functional.linear", ((1, 1),), module="model.layers.*.self_attn.o_proj")
    with pytest.raises(PolicyError) as info:
        parse_constraints('- name: torch.sum\n  allowed_partition_dims: ["0,0"]\n  module: [layers]\n')
    assert str(info.value) == ("<yaml> entry 0 (line 3): field 'module' got ['layers']; expected a module path glob "
                               "from the root model such as model.layers.*.self_attn.q_proj")


def _assert_column_row(plan, layers=2):
    for i in range(layers):
        for names, dim in zip(COLUMN_ROW, (0, 1)):
            for name in names:
                part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                assert plan.params[f"model.layers.{i}.{part}.{name}.weight"][-1] == Shard(dim), name


def test_hf_base_model_tp_plan_as_constraints_equals_one_device():
    """The headline: constraints=model.config.base_model_tp_plan (keys relative to the base model) on 4 ranks."""
    plan_dict = hf_zoo.tiny_config("llama").base_model_tp_plan
    model, _ = compare("llama", (4,), constraints=plan_dict)
    _assert_column_row(model.policy_plan)


def test_hf_model_plans_on_2x2_shards_the_tp_dim_as_the_plan_says():
    """model_plans(model): the class's lm_head entry and the embedding too; on (dp, tp) the plan's dim is tp. Entries
    naming nothing in the model are dropped with a warning, as transformers drops them."""
    with pytest.warns(UserWarning, match=r"unused plan entry Qwen3MoeForCausalLM tp_plan\['model.layers.\*.mlp.gate_"):
        assert "model.layers.*.mlp.gate_proj" not in model_plans(hf_zoo.tiny_model("qwen3_moe")).tp
    plans = model_plans(hf_zoo.tiny_model("qwen2", use_cache=False))
    assert plans.tp["lm_head"] == "colwise_gather_output" and plans.tp["model.embed_tokens"] == "embedding_rowwise"
    model, _ = compare("qwen2", (2, 2), constraints=plans)
    plan = model.policy_plan
    _assert_column_row(plan)
    assert plan.params["lm_head.weight"][1] == Shard(0) and plan.params["model.embed_tokens.weight"][1] == Shard(0)


def test_shipped_fqn_yamls_tell_q_proj_from_o_proj():
    """The shipped HF YAMLs scope by module path: q/k/v/gate/up column-, o/down row-parallel on Mistral (its values
    are the Llama test's plan's); Mixtral's attention alike, its experts left to the solver."""
    ids = hf_zoo.sample_batch()[0]
    mistral, mixtral = (hf_zoo.tiny_model(name, use_cache=False) for name in ("mistral", "mixtral"))
    with simulated_mesh((4,)) as mesh:
        _assert_column_row(build_plan(mistral, mesh, (ids, None, None, None, None, ids),
                                      constraints=policy_text("hf_llama_tp")))
        params = build_plan(mixtral, mesh, (ids, None, None, None, None, ids), constraints=policy_text("hf_moe_tp")
                            ).params
    assert [params[f"model.layers.1.self_attn.{name}.weight"] for name in ("q_proj", "v_proj", "o_proj")] == [
        (Shard(0),), (Shard(0),), (Shard(1),)]


def test_torchtitan_style_dict_as_constraints(mesh_1d2):
    """torchtitan's hand plan for TinyLlama (Colwise/Rowwise, SequenceParallel norms, PrepareModuleInput) is read as
    constraints, solved and proven: the weights where the styles put them, the norms sequence-sharded."""
    config = LlamaConfig(n_layers=1)
    torch.manual_seed(0)
    model, reference = TinyLlama(config), TinyLlama(config)
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    plan = build_plan(model, mesh_1d2, (tokens,), constraints=torchtitan_plan(config))
    params = plan.params
    assert params["layers.0.attention.wq.weight"] == (Shard(0),) and params["layers.0.feed_forward.w2.weight"] == (
        Shard(1),)
    assert params["tok_embeddings.weight"] == (Shard(0),) and params["output.weight"] == (Shard(0),)
    norms = [op for op in plan.ops if op.node.signature == "torch.nn.functional.rms_norm"]
    assert len(norms) == 3 and all(op.inputs[0] == (Shard(1),) for op in norms)
    assert_applied_plan_matches(model, reference, mesh_1d2, tokens, plan)


def test_module_glob_in_a_policy_and_a_yaml_entry_matching_nothing(mesh_1d2):
    model = TinyLlama()
    tokens = torch.randint(0, 32, (2, 8))
    graph = trace_graph(model, (tokens,))
    assert [op.fqn for op in get_pas_ops(graph, module="layers.*.attention.w[qk]")] == [
        "layers.0.attention.wq", "layers.0.attention.wk", "layers.1.attention.wq", "layers.1.attention.wk"]
    with pytest.raises(PolicyError) as info:
        build_plan(model, mesh_1d2, (tokens,), constraints='- name: torch.nn.functional.linear\n'
                                                            '  module: "layers.*.attention.o_proj"\n'
                                                            '  allowed_partition_dims: ["1,1"]\n')
    assert str(info.value) == (
        "<yaml> entry 0 (line 1): field 'module' got 'layers.*.attention.o_proj'; expected an fqn glob over the "
        "paths of the modules around torch.nn.functional.linear or the parameters it reads; it runs in "
        "layers.0.attention.wk, layers.0.attention.wo, layers.0.attention.wq, layers.0.attention.wv, ... "
        "(15 modules)")


def test_hf_styles_cover_transformers_registry_and_refusals_name_the_entry(mesh_1d4):
    """Every style name transformers registers is mapped (or refused when it is used); a packed weight's strided
    shard, an unknown style, a key naming nothing and a partition DTensor cannot run are refused by entry."""
    from transformers.distributed import expert_parallel  # noqa: F401  (registers the EP styles)
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    assert set(ALL_PARALLEL_STYLES) == set(STYLES)
    model = hf_zoo.tiny_model("mixtral", use_cache=False)
    graph = trace_graph(model, (hf_zoo.sample_batch()[0],))

    def refusal(plan) -> str:
        with pytest.raises(PolicyError) as info:
            as_constraints(plan, graph, mesh_1d4)
        return str(info.value)

    assert refusal(model_plans(model)).startswith(
        "MixtralForCausalLM tp_plan['model.layers.*.mlp.experts.gate_up_proj'] = 'packed_colwise': field '<style>' "
        "got 'packed_colwise'; expected a style whose partition is a Shard: packed_colwise splits the packed halves "
        "of gate_up_proj each (_StridedShard(dim=1, split_factor=2))")
    ep = model_plans(model, ep=True)  # the EP plan: its modules take no TP entry; experts sharded by expert
    assert not any(".experts" in key for key in ep.tp) and set(ep.ep.values()) == {"grouped_gemm",
                                                                                    "ep_dispatch_experts"}
    assert {(c.name, c.module, c.allowed_partition_dims, c.holds) for c in as_constraints(HFPlan({}, ep.ep), graph,
                                                                                            mesh_1d4)} == {
        ("torch.Tensor.transpose", f"model.layers.*.mlp.experts.{name}", ((0, 0),), True)
        for name in ("gate_up_proj", "down_proj")}
    assert refusal({"layers.*.mlp.gate": "colwize"}).startswith(
        "tp_plan['layers.*.mlp.gate'] = 'colwize': field '<style>' got 'colwize'; expected a transformers 5.x style "
        "name: colwise, colwise_rep, ")
    assert refusal({"layers.*.mlp.up_proj": "colwise"}).startswith(
        "tp_plan['layers.*.mlp.up_proj'] = 'colwise': field '<key>' got 'layers.*.mlp.up_proj'; expected an fqn glob "
        "matching a module or parameter of MixtralForCausalLM from the root or from its base model `model`")
    with pytest.raises(PolicyError) as info:  # 130 vocabulary rows do not split evenly over 4 ranks
        build_plan(hf_zoo.tiny_model("llama", use_cache=False, vocab_size=130), mesh_1d4,
                   (hf_zoo.sample_batch()[0],), constraints=HFPlan({"embed_tokens": "embedding_rowwise"}))
    assert str(info.value).startswith("tp_plan['embed_tokens'] = 'embedding_rowwise' (weight Shard(0)): %0 "
                                      "torch.nn.functional.embedding in model.embed_tokens")
    assert "input 1 dim 0 (size 130) cannot be split evenly over 4 ranks" in str(info.value)


def test_style_dicts_refuse_what_torch_refuses(mesh_1d2):
    model = TinyLlama()
    tokens = torch.randint(0, 32, (2, 8))
    graph = trace_graph(model, (tokens,))
    with pytest.raises(PolicyError) as info:
        as_constraints({"norm": ColwiseParallel()}, graph, mesh_1d2)
    assert str(info.value) == ("style dict['norm'] = ColwiseParallel: field '<key>' got 'norm'; expected an "
                               "nn.Linear or nn.Embedding: torch's ColwiseParallel shards only those (got RMSNorm)")
    with pytest.raises(PolicyError) as info:  # wo is a linear of the attention too, but reads its own input
        as_constraints({"layers.0.attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                                                 desired_input_layouts=(Shard(1),))}, graph, mesh_1d2)
    assert str(info.value).startswith(
        "style dict['layers.0.attention'] = PrepareModuleInput: field '<input>' got 0; expected a module whose ops "
        "reading its input share no name with its other ops: %2 torch.nn.functional.linear in layers.0.attention.wq")
    with pytest.raises(PolicyError) as info:
        as_constraints({"output.weight": ColwiseParallel()}, graph, mesh_1d2)
    assert str(info.value) == ("style dict['output.weight'] = ColwiseParallel: field '<key>' got 'output.weight'; "
                               "expected an fqn glob naming modules (it names parameters: output.weight)")
    assert as_constraints({"output": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())},
                          graph, mesh_1d2) == []


def test_tied_embeddings_take_one_placement(mesh_1d2):
    """A tied table is one parameter: the lm_head's and the embedding's entries must hold it alike."""
    model = hf_zoo.tiny_model("llama", use_cache=False, tie_word_embeddings=True)
    with pytest.raises(PolicyError) as info:
        build_plan(model, mesh_1d2, (hf_zoo.sample_batch()[0],),
                   constraints={"embed_tokens": "embedding_colwise", "lm_head": "colwise"})
    assert str(info.value).startswith("tp_plan['lm_head'] = 'colwise' (weight Shard(0)): %")
    assert str(info.value).endswith(
        "expected one placement for model.embed_tokens.weight on mesh dim 0; tp_plan['embed_tokens'] = "
        "'embedding_colwise' (weight Shard(1)): %0 torch.nn.functional.embedding in model.embed_tokens "
        "[self.embed_tokens(input_ids)] holds it at S(1)")


def test_plans_read_alike_from_a_model_on_the_meta_device(mesh_1d2):
    """A fake trace holds fake copies of the parameters: the style dict and Hugging Face's plan still find each
    parameter by its path (the same placements as from the materialized model), and a tied table is still one."""
    config = LlamaConfig(n_layers=1)
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    with torch.device("meta"):
        meta_llama = TinyLlama(config)
    plans = [build_plan(model, mesh_1d2, (tokens,), constraints=torchtitan_plan(config))
             for model in (TinyLlama(config), meta_llama)]
    assert plans[1].params == plans[0].params and plans[1].params["tok_embeddings.weight"] == (Shard(0),)

    with torch.device("meta"):
        tied = hf_zoo.tiny_model("llama", use_cache=False, tie_word_embeddings=True)
    with pytest.raises(PolicyError) as info:
        build_plan(tied, mesh_1d2, (hf_zoo.sample_batch()[0],),
                   constraints={"embed_tokens": "embedding_colwise", "lm_head": "colwise"})
    assert str(info.value).endswith(
        "expected one placement for model.embed_tokens.weight on mesh dim 0; tp_plan['embed_tokens'] = "
        "'embedding_colwise' (weight Shard(1)): %0 torch.nn.functional.embedding in model.embed_tokens "
        "[self.embed_tokens(input_ids)] holds it at S(1)")
