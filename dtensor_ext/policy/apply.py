"""parallelize: the plan applied in place, run as the traced program where it replays, else by the interpreter.

The program (policy.program) is what torch.compile traces into one graph and what other tools' module hooks do not
change; the interpreter (policy.interpreter, with torch's ParallelStyles where proven) runs the model's own forward
and so also what a replay cannot: an OpPlan policy's module hooks and recompute groups, a forward that reads tensor
values into Python. Which one runs, and why, is on the plan (``plan.runs_as``).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ext.policy.adapter import build_plan
from dtensor_ext.policy.errors import PolicyError
from dtensor_ext.policy.interpreter import PlanExecutor
from dtensor_ext.policy.plan import RUNS_AS_PROGRAM, Plan
from dtensor_ext.policy.program import PlanProgram, module_hooks_refusal, replay_refusal
from dtensor_ext.policy.regions import apply_recompute
from dtensor_ext.policy.styles import apply_styles, proven_styles
from dtensor_ext.policy.trace import on_meta

__all__ = ["parallelize"]

# build_plan's keyword arguments a caller may give parallelize (fake_trace and held_params are parallelize's to set)
_PLAN_OPTIONS = {name for name, p in inspect.signature(build_plan).parameters.items()
                 if p.kind is p.KEYWORD_ONLY} - {"fake_trace", "held_params"}


def parallelize(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    example_inputs: Sequence[object],
    *,
    plan: Plan | None = None,
    styles: bool = True,
    program: bool | None = None,
    **plan_options,
) -> torch.nn.Module:
    """Build the plan (unless given; ``plan_options`` are ``build_plan``'s keyword arguments: constraints, policy,
    memory_budget, ...) and apply it in place: parameters distributed as solved, every op run on DTensors moved to
    the solved placements. Returns the module, whose outputs are full (replicated) tensors; the applied plan is
    ``model.policy_plan``, and ``plan.runs_as`` says how it runs.

    ``program``: None (the default) runs the plan as its traced program wherever a replay can run it, planned on
    fake tensors (the program torch.compile traces into one graph; a call of other shapes or arguments is planned
    when it first comes, with the parameters held as distributed: ``plan.other_calls``), and by the interpreter
    where it cannot: an OpPlan ``policy`` (its module hooks and recompute groups), a module with hooks (another
    tool's), a forward that reads tensor values into Python (planned again from one eager forward), or a given
    ``plan`` a replay cannot run. A module hook registered, a parameter replaced or redistributed after
    parallelize is a PolicyError at the program's next eager call (the replay would not run it). True: the
    program, or a PolicyError naming why not. False: the interpreter (the model's own forward, its calls met by a
    TorchFunctionMode), with torch's ``parallelize_module`` running a module wherever a ColwiseParallel,
    RowwiseParallel or SequenceParallel provably does what the plan says (``styles=False``: never)."""
    if program is not None and not isinstance(program, bool):
        raise PolicyError("parallelize", "program", program, "None (the program where it replays), True or False")
    unknown = sorted(set(plan_options) - _PLAN_OPTIONS)
    if unknown:
        known = sorted({"plan", "styles", "program", *_PLAN_OPTIONS})
        raise PolicyError("parallelize", unknown[0], plan_options[unknown[0]],
                          f"a keyword argument of parallelize or build_plan ({', '.join(known)})")
    if isinstance(plan_options.get("constraints"), Iterator):  # read again for each call signature the program plans
        plan_options["constraints"] = list(plan_options["constraints"])
    policy = plan_options.get("policy")

    def plan_for(inputs, held_params=None, fake_trace=True):
        return build_plan(model, mesh, inputs, **plan_options, fake_trace=fake_trace, held_params=held_params)

    hooked = None if program is False else module_hooks_refusal(model)
    if program and hooked is not None:
        raise hooked
    if plan is None:
        plan, reason = _planned(plan_for, model, example_inputs, program, policy, hooked)
    else:
        reason = None if program else "program=False" if program is False else hooked or replay_refusal(plan)
    if program and reason is not None:
        raise reason
    if reason is None:
        plan.styles, plan.runs_as = {}, RUNS_AS_PROGRAM
        PlanProgram(plan, plan_for).install(model, example_inputs)
    else:
        plan.styles = proven_styles(plan) if styles else {}
        plan.runs_as = f"the interpreter (policy.interpreter), {_why(reason)}"
        if reason != "program=False":  # a fallback the caller did not ask for is said, not only recorded
            warnings.warn(f"parallelize: the plan runs by {plan.runs_as}; under torch.compile each of its ops breaks "
                          "the graph (plan.runs_as)", stacklevel=2)
        apply_styles(model, plan, plan.styles)
        PlanExecutor(plan).install(model)
        for fqn, pre, post in plan.hooks:
            module = model.get_submodule(fqn)
            if pre is not None:
                module.register_forward_pre_hook(pre)
            if post is not None:
                module.register_forward_hook(post)
        apply_recompute(model, plan.recompute_groups)
    model.policy_plan = plan
    return model


def _planned(plan_for, model, example_inputs, program: bool | None, policy, hooked) -> tuple[Plan, object]:
    """The plan and why the interpreter runs it (None: the program runs it)."""
    if program is False:
        return plan_for(example_inputs, fake_trace=None), "program=False"
    if program is None and policy is not None:
        return plan_for(example_inputs, fake_trace=None), "an OpPlan policy (its hooks and recompute groups run on " \
                                                          "the model's modules)"
    if hooked is not None:  # another tool's module hooks: the interpreter runs the model's own forward, hooks and all
        return plan_for(example_inputs, fake_trace=None), hooked
    meta = on_meta(model, example_inputs)
    try:
        plan = plan_for(example_inputs)
    except PolicyError as read:
        if program or meta or read.field != "trace":
            raise
        return plan_for(example_inputs, fake_trace=None), read  # the forward reads values: plan from one eager run
    refusal = replay_refusal(plan)
    if refusal is None or program or meta:
        return plan, refusal
    return plan_for(example_inputs, fake_trace=None), refusal  # the interpreter runs the model's eager forward


def _why(reason) -> str:
    """Why the interpreter runs the plan, as `plan.runs_as` says it."""
    if isinstance(reason, str):
        return f"as asked: {reason}" if reason == "program=False" else f"for {reason}"
    if reason.field == "trace":
        return f"for the forward reads a tensor's values into Python at {reason.where} ({reason.value})"
    if reason.field == "module hooks":
        return f"for {reason.where} has {reason.value} hooks (the program calls no module)"
    return f"for a replay cannot run it: {reason}"
