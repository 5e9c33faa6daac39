"""The plan replayed as straight-line code (parallelize's default where a replay runs the plan; program=True: always).
It equals one device, runs the collectives the plan lists whatever other tools hook onto the modules, refuses what
it cannot replay by name (the default runs such a plan by the interpreter and says why), and compiles into one graph
on real gloo ranks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dtensor_ext.models import TinyLlama, policy_text
from dtensor_ext.policy import PolicyError, build_plan, parallelize
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.tools.comm_stats import CommStatsMode
from dtensor_ext.testing.ranks import run_ranks
from tests.policy.checks import assert_every_rank_matches
from tests.policy.test_guarantee import check_matches_one_device
from tests.policy.test_meta_planning import _Branches

hf_zoo = pytest.importorskip("dtensor_ext.testing.hf_zoo")

LLAMA_TP_YAML = policy_text("llama_tp_sp")
HF_LINEARS = policy_text("linears_column_or_row")


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_the_replayed_plan_equals_one_device(mesh_shape):
    names = ("dp", "tp") if len(mesh_shape) == 2 else None
    plan = check_matches_one_device(TinyLlama, (torch.randint(0, 32, (2, 8)),), mesh_shape=mesh_shape,
                                    mesh_dim_names=names, constraints=LLAMA_TP_YAML, program=True)
    assert not plan.deviations and not plan.styles
    assert plan.params["layers.0.attention.wq.weight"][-1].is_shard(0)


def test_constraints_given_as_a_generator_plan_every_call_signature():
    """The program plans a new call signature with the constraints the first plan had: a generator of Constraints
    is read once, and kept."""
    from dtensor_ext.policy.constraints import load_constraints

    torch.manual_seed(0)
    model = TinyLlama()
    with simulated_mesh((2,)) as mesh:
        parallelize(model, mesh, (torch.randint(0, 32, (2, 8)),), constraints=iter(load_constraints(LLAMA_TP_YAML)),
                    program=True)
        model(torch.randint(0, 32, (2, 4)))
    (other,) = model.policy_plan.other_calls.values()
    assert other.params["layers.0.attention.wq.weight"][-1].is_shard(0)
    assert all(op.inputs[1][-1].is_shard(0) for op in other.ops if op.node.fqn.endswith("attention.wq"))


def test_held_params_pin_the_parameters_and_a_bad_entry_is_named():
    """build_plan(held_params=), which plans the program's new call signatures: a held parameter gets exactly
    its placements, even where the search alone puts it elsewhere; a bad entry is a PolicyError naming it."""
    from torch.distributed.tensor import Partial, Shard

    torch.manual_seed(0)
    model, tokens = TinyLlama(), torch.randint(0, 32, (2, 8))
    with simulated_mesh((2,)) as mesh:
        free = build_plan(model, mesh, (tokens,), constraints=LLAMA_TP_YAML).params["layers.0.attention.wq.weight"]
        plan = build_plan(model, mesh, (tokens,), constraints=LLAMA_TP_YAML,
                          held_params={"layers.0.attention.wq.weight": (Shard(1),)})
        with pytest.raises(PolicyError, match="field 'held_params' got 'nope'; expected names of the model's"):
            build_plan(model, mesh, (tokens,), held_params={"nope": (Shard(0),)})
        with pytest.raises(PolicyError, match=r"got \(Partial\(sum\),\); expected one Replicate or Shard per mesh"):
            build_plan(model, mesh, (tokens,), held_params={"layers.0.attention.wq.weight": (Partial(),)})
    assert free != (Shard(1),) and plan.params["layers.0.attention.wq.weight"] == (Shard(1),)


def test_example_inputs_other_than_the_plans_are_refused():
    """The program keys the traced call by the example inputs: a plan traced at other shapes is refused by name."""
    torch.manual_seed(0)
    model = TinyLlama()
    with simulated_mesh((2,)) as mesh:
        plan = build_plan(model, mesh, (torch.randint(0, 32, (2, 8)),), constraints=LLAMA_TP_YAML)
        with pytest.raises(PolicyError, match=r"parallelize: field \"example_inputs\['tokens'\]\" got 'a tensor of "
                                              r"shape \[2, 4\]'; expected a tensor of shape \[2, 8\] in the call"):
            parallelize(model, mesh, (torch.randint(0, 32, (2, 4)),), plan=plan, program=True)


def test_a_trace_that_read_values_is_not_replayed():
    torch.manual_seed(0)
    model = _Branches()
    with simulated_mesh((2,)) as mesh:
        plan = build_plan(model, mesh, (torch.randn(4, 8),), constraints=(
            '- name: torch.nn.functional.linear\n  allowed_partition_dims: ["1,0"]\n  replica_allowed: false\n'))
        with pytest.raises(PolicyError) as info:
            parallelize(model, mesh, (torch.randn(4, 8),), plan=plan, program=True)
    assert str(info.value).startswith("%3 torch.Tensor.__bool__ in <root> [h.sum() > 0]: field 'program' got "
                                      "\"a call that reads a tensor's values into Python\""), info.value


COLUMN_PARALLEL = '- name: torch.nn.functional.linear\n  allowed_partition_dims: ["1,0"]\n  replica_allowed: false\n'


def test_the_default_runs_by_the_interpreter_what_a_replay_cannot_and_says_why():
    torch.manual_seed(0)
    # planned from one eager forward (the fake trace cannot take the branch), run by the interpreter: one device
    with pytest.warns(UserWarning, match=r"^parallelize: the plan runs by the interpreter \(policy.interpreter\), "
                                         r"for the forward reads"):
        plan = check_matches_one_device(_Branches, (torch.randn(4, 8),), constraints=COLUMN_PARALLEL)
    assert plan.runs_as == ("the interpreter (policy.interpreter), for the forward reads a tensor's values into "
                            "Python at <root> [h.sum() > 0] (torch.Tensor.__bool__)"), plan.runs_as
    assert any(node.reads_values for node in plan.graph.nodes)
    with simulated_mesh((2,)) as mesh:
        given = build_plan(_Branches(), mesh, (torch.randn(4, 8),), constraints=COLUMN_PARALLEL)
        parallelize(model := _Branches(), mesh, (torch.randn(4, 8),), plan=given)
        assert model.policy_plan.runs_as.startswith("the interpreter (policy.interpreter), for a replay cannot run "
                                                    "it: %3 torch.Tensor.__bool__ in <root> [h.sum() > 0]: field "
                                                    "'program'"), model.policy_plan.runs_as
        with pytest.raises(PolicyError) as info:
            parallelize(_Branches(), mesh, (torch.randn(4, 8),), plan=given, program="yes")
    assert str(info.value) == ("parallelize: field 'program' got 'yes'; expected None (the program where it "
                               "replays), True or False")
    with pytest.raises(PolicyError, match=r"^parallelize: field 'constrains' got 'x'; expected a keyword argument of "
                                          r"parallelize or build_plan \(cfg, constraints, "):
        parallelize(_Branches(), mesh, (torch.randn(4, 8),), constrains="x")


def test_module_hooks_are_run_by_the_interpreter_and_refused_after_the_program_is_installed():
    """The replay calls no module: a module hook (activation checkpointing's, FSDP's) would not run. One present
    at parallelize sends the plan to the interpreter, which runs it; one registered later, or a parameter
    redistributed later, is refused at the next call by name. The model's own hooks run (it is called)."""
    torch.manual_seed(0)
    calls = []

    def with_hook():
        model = TinyLlama()
        model.layers.get_submodule("0").register_forward_hook(lambda *_: calls.append("ran"))
        return model

    tokens = (torch.randint(0, 32, (2, 8)),)
    plan = check_matches_one_device(with_hook, tokens, mesh_shape=(2,), constraints=LLAMA_TP_YAML)
    assert plan.runs_as == ("the interpreter (policy.interpreter), for layers.0 has forward hooks (the program calls "
                            "no module)") and calls, plan.runs_as
    with simulated_mesh((2,)) as mesh:
        with pytest.raises(PolicyError, match=r"^layers\.0: field 'module hooks' got 'forward'"):
            parallelize(with_hook(), mesh, tokens, constraints=LLAMA_TP_YAML, program=True)
        model = parallelize(TinyLlama(), mesh, tokens, constraints=LLAMA_TP_YAML)
        model.register_forward_hook(lambda *_: calls.append("root"))
        model(*tokens)
        assert calls[-1] == "root" and model.policy_plan.runs_as == "the traced program (policy.program)"
        handle = model.get_submodule("layers.1.attention").register_forward_pre_hook(lambda *_: None)
        with pytest.raises(PolicyError, match=r"^layers\.1\.attention: field 'module hooks' got 'forward pre'; "
                                              r"expected no module hook on a model run as its traced program"):
            model(*tokens)
        handle.remove()
        name, weight = next((n, p) for n, p in model.named_parameters() if p.placements[0].is_shard())
        module_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module_name), leaf,
                torch.nn.Parameter(weight.redistribute(mesh, [torch.distributed.tensor.Replicate()])))
        with pytest.raises(PolicyError, match=rf"^{name}: field 'parameter' got 'a DTensor on mesh \(2,\) at "
                                              r"\(Replicate\(\),\)'; expected the DTensor parallelize made"):
            model(*tokens)


@pytest.fixture(scope="module")
def hf_llama_program():
    """HF Llama planned on fake tensors (its traced path: explicit masks) and replayed, on 4 simulated ranks (the
    mesh stays open for the module's later tests: the simulated-mesh tests come before it)."""
    reference, model = hf_zoo.tiny_model("llama"), hf_zoo.tiny_model("llama")
    ids, labels = hf_zoo.sample_batch()
    with simulated_mesh((4,)) as mesh:
        parallelize(model, mesh, (ids,), constraints=HF_LINEARS, program=True)
        yield model, reference, ids, labels


def test_a_hugging_face_model_replays_its_traced_path_as_one_device(hf_llama_program):
    model, reference, ids, _ = hf_llama_program
    expected = reference(ids).logits
    expected.square().mean().backward()
    out = model(ids).logits
    assert_every_rank_matches(out, expected)
    out.square().mean().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_every_rank_matches(p.grad.full_tensor(), q.grad)
        p.grad, q.grad = None, None
    assert not model.policy_plan.deviations


def test_the_replay_runs_the_listed_collectives_under_other_tools_hooks(hf_llama_program):
    """The replay calls no module, so CommDebugMode's module tracker (and any module hook) changes nothing."""
    from torch.distributed.tensor.debug import CommDebugMode

    model, _, ids, _ = hf_llama_program
    plan = model.policy_plan
    listed = plan.forward_collectives()
    with CommDebugMode(), CommStatsMode() as comm, torch.no_grad():
        model(ids)
    assert dict(comm.stats.collectives) == dict(Counter(kind for kind, _ in listed)), str(plan)
    assert sum(comm.stats.received_bytes.values()) == sum(nbytes for _, nbytes in listed)
    assert not plan.deviations


def test_a_call_of_another_signature_is_planned_when_it_comes_with_the_parameters_held(hf_llama_program):
    """Planned from `(ids,)`: a call with `labels=` and one with half the sequence each get their own traced program
    (planned at their first call, the parameters held where they are) and equal one device; a second call of a
    signature replays its program without planning again."""
    model, reference, ids, labels = hf_llama_program
    plan = model.policy_plan
    for call in ({"input_ids": ids, "labels": labels}, {"input_ids": ids[:, :8]}):
        expected = reference(**call)
        (expected.loss if "labels" in call else expected.logits.square().mean()).backward()
        for _ in range(2):
            out = model(**call)
            assert_every_rank_matches(out.logits, expected.logits)
        (out.loss if "labels" in call else out.logits.square().mean()).backward()
        if "labels" in call:
            assert_every_rank_matches(out.loss, expected.loss)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert_every_rank_matches(p.grad.full_tensor(), q.grad)
            p.grad, q.grad = None, None
    assert list(plan.other_calls) == ["input_ids=[2, 16], labels=[2, 16]", "input_ids=[2, 8]"]
    for other, traced in zip(plan.other_calls.values(), ([[2, 16], [2, 16]], [[2, 8]])):
        root = other.graph.module_calls[""]
        assert [list(other.graph.tensors[tid].shape) for tid in root.arg_ids if tid is not None] == traced
        assert other.params == {name: plan.params[name] for name in other.params}
        assert not other.deviations
    assert not plan.deviations


def test_what_the_replay_cannot_key_is_refused_by_name(hf_llama_program):
    model, _, ids, _ = hf_llama_program
    with pytest.raises(PolicyError, match=r"field 'past_key_values' got 'an instance of object'; expected tensors or "
                                          r"plain Python values"):
        model(ids, past_key_values=object())


def _gloo_collectives(step) -> Counter:
    """The gloo collectives `step()` ran, by kind (the profiler's events: also what compiled code runs)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return Counter(e.name.removeprefix("gloo:") for e in prof.events() if e.name.startswith("gloo:"))


def _compiled_step(rank: int, name: str) -> dict:
    """A Hugging Face model on 2 gloo ranks: parallelize (its default, the program), one forward + backward
    eagerly, then under torch.compile (aot_eager); the collectives each ran, and the compiled step's values against
    one device."""
    import torch._dynamo
    from torch.distributed.device_mesh import init_device_mesh

    from torch._dynamo.utils import counters

    reference, model = hf_zoo.tiny_model(name), hf_zoo.tiny_model(name)
    ids, labels = hf_zoo.sample_batch()
    expected = reference(ids).logits
    expected.square().mean().backward()
    mesh = init_device_mesh("cpu", (2,))
    parallelize(model, mesh, (ids,), constraints=HF_LINEARS)
    plan = model.policy_plan
    assert plan.runs_as == "the traced program (policy.program)", plan.runs_as
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    eager = _gloo_collectives(lambda: model(ids).logits.square().mean().backward())
    model.zero_grad()
    torch._dynamo.reset()
    compiled, out = torch.compile(model, backend=counting), []
    ran = _gloo_collectives(lambda: out.append(compiled(ids).logits) or out[0].square().mean().backward())
    result = dict(graphs=len(graphs), logits=float((out[0] - expected).abs().max()),
                  grads=max(float((p.grad.full_tensor() - q.grad).abs().max())
                            for p, q in zip(model.parameters(), reference.parameters())),
                  eager=eager, compiled=ran, grads_partial=[n for n, p in model.named_parameters()
                                                             if any(x.is_partial() for x in p.grad.placements)],
                  listed=Counter(kind for kind, _ in (*plan.forward_collectives(), *plan.backward_collectives())))
    if name == "llama":  # a call of another signature: planned at its first call (one break there), then one graph
        loss = reference(ids, labels=labels).loss
        result["labels_calls"] = []
        for _ in range(2):
            before, breaks = len(graphs), sum(counters["graph_break"].values())
            got = compiled(ids, labels=labels).loss
            result["labels_calls"].append((len(graphs) - before, sum(counters["graph_break"].values()) - breaks,
                                           float((got - loss).abs())))
    return result


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_the_replayed_plan_compiles_into_one_graph_on_gloo_ranks(name):
    """One graph, equal to one device, and running, eager and compiled, the collectives the plan lists (under
    torch.compile the backward once reduced Partial gradients where DTensor met them, not where the plan does).
    Llama then takes `labels=`, a signature it was not planned for: planned at that call (the one graph break),
    one graph from its second call on. Mixtral's router normalizes its top-k weights in place (`router_top_value
    /= ...`): an output written later, whose gradient the program brings by a tensor hook (a tensor hook that read
    the gradient's placements broke the graph there, and the graph that followed failed in AOT autograd's alias
    replay: `as_strided` of a DTensor)."""
    for rank, result in run_ranks(_compiled_step, name, world=2, timeout_s=400).items():
        assert result["graphs"] == 1, (rank, result)  # one graph: no graph break
        assert result["logits"] < 1e-5 and result["grads"] < 1e-4, (rank, result)
        assert result["listed"]["all_reduce"], result  # the plan reduces gradients: a case that tells
        assert result["eager"] == result["listed"] and result["compiled"] == result["listed"], (rank, result)
        assert not result["grads_partial"], (rank, result)
        if name == "llama":
            (graphs, breaks, error), (graphs_again, breaks_again, error_again) = result["labels_calls"]
            assert breaks == 1 and graphs_again == 1 and breaks_again == 0, (rank, result)
            assert error < 1e-5 and error_again < 1e-5, (rank, result)
