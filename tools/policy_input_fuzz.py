"""Count how fuzzed policy inputs fail: run by hand, e.g. ``python tools/policy_input_fuzz.py --yaml 4000 --plans 1000``.

Feeds seeded random YAML documents (valid constraint files garbled character by character, hostile snippets spliced
in, alias bombs, deep nesting, random trees) to ``parse_constraints``, and random ``OpPartition``/``OpPlan``
arguments to their constructors and then to ``build_plan`` on a small MoE model. Prints, per input kind, how many
were accepted, refused with PolicyError, raised anything else (by type) or ran past the time limit, plus the inputs
accepted although invalid (an empty document, non-ASCII digits, a negative or non-integer input index).
Run it against another checkout with ``PYTHONPATH=<checkout>`` to compare.
"""

from __future__ import annotations

import argparse
import collections
import random
import signal
import time
import warnings

import torch
import yaml

import dtensor_ext
from dtensor_ext.models import MoEModel
from dtensor_ext.policy import OpPartition, OpPlan, PlanWarning, PolicyError, build_plan
from dtensor_ext.policy.constraints import parse_constraints
from dtensor_ext.testing import simulated_mesh

VALID = [
    '- name: torch.sum\n  allowed_partition_dims: ["0,0", "1,-1"]\n  parent_module: MoE\n  replica_allowed: false\n',
    "- allowed_partition_dims:\n  - 0,0\n  - 1,-1\n  name: mylib::top2gating\n  parent_module: Top2Gate\n",
    '- &base {name: torch.einsum, allowed_partition_dims: ["0,0"], mesh_dim: ep}\n- <<: *base\n  name: torch.sum\n',
    '- name: torch.nn.functional.linear\n  allowed_partition_dims: ["1,0", "1,1"]\n  mesh_dim: tp\n',
]
SNIPPETS = ["&a ", "*a", "<<: *a", "<<: [*a, 5]", "!!python/name:os.system ''", "!!timestamp x", "2001-13-45",
            "!!int abc", "!!float x", "!!binary ???", "!!set {a}", "!!omap [a]", "? [a, b]\n  : 1", "~", ".inf",
            "9" * 5000 + ",0", "\u0663,\u0660", "\uff11,0", "1_0,0", "-2,0", "0,0,0", "---\n- a\n", "{", "]", ": :",
            "\t", "\x00", "'", '"', "|", ">", "%YAML 1.1", "@", "`", "#", "- - - -", "\n  - ", "[]", "{}"]
ALPHABET = "[]{}:,-&*!<>|'\"#%@`?\n\t  abcxyz0123456789_.\u0663\u00e9"


def bomb(rng: random.Random) -> str:
    """Nested aliases ("billion laughs"): as the whole document, or inside one field of an entry."""
    width, levels = rng.randint(3, 9), rng.randint(4, 10)
    layers = [f"&l0 [{', '.join(['lol'] * width)}]"]
    layers += [f"&l{k} [{', '.join([f'*l{k - 1}'] * width)}]" for k in range(1, levels)]
    where = rng.choice(["document", "name", "allowed_partition_dims", "bogus"])
    if where == "document":
        return "".join(f"l{k}: {layer}\n" for k, layer in enumerate(layers))
    field = f"  {where}: [{', '.join(layers)}]\n"
    return "- " + field[2:] + ("  name: x\n" if where != "name" else "") + '  allowed_partition_dims: ["0,0"]\n'


def nesting(rng: random.Random) -> str:
    depth = rng.randint(10, 800)
    if rng.random() < 0.5:
        return "[" * depth + "]" * depth
    return "".join("  " * k + "-\n" for k in range(depth)) + "  " * depth + "x\n"


def tree(rng: random.Random, depth: int = 0) -> object:
    roll = rng.random()
    if depth > 3 or roll < 0.4:
        return rng.choice([None, True, 3, -1, "0,0", "1,-1", "torch.sum", "MoE", "a,b", "", "tp", 2.5])
    if roll < 0.7:
        return [tree(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["name", "allowed_partition_dims", "parent_module", "replica_allowed", "mesh_dim", "bogus", "<<"]
    return {rng.choice(keys): tree(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def garble(rng: random.Random, text: str) -> str:
    chars = list(text)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randint(0, len(chars))
        op = rng.random()
        if op < 0.4 and chars:
            del chars[min(pos, len(chars) - 1)]
        elif op < 0.7:
            chars.insert(pos, rng.choice(ALPHABET))
        else:
            chars[pos:pos] = list(rng.choice(SNIPPETS))
    return "".join(chars)


def yaml_input(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.015:
        return bomb(rng)
    if kind < 0.04:
        return nesting(rng)
    if kind < 0.06:
        return rng.choice(["", "# nothing\n", "[]", "---\n", "\n\n"])
    if kind < 0.4:
        return yaml.safe_dump(tree(rng)) + rng.choice(["", "]", "- [", ": :", "\t", "&x", "*x"])
    if kind < 0.5:  # a valid entry with a non-ASCII or odd dim
        dim = rng.choice(["\u0663,0", "0,\u0661", "\uff10,0", "1_0,0", "+0,0", " 0 , 1 ", "-1,0", "0,-1"])
        return f'- name: torch.sum\n  allowed_partition_dims: ["{dim}"]\n'
    return garble(rng, rng.choice(VALID))


POOL = [0, 1, 2, -1, -2, 5, True, None, "0", 1.0, [0], 2**70, "auto", "shard", (0, 1)]


def plan_input(rng: random.Random) -> dict:
    partition = rng.choice([lambda: "auto", lambda: None, lambda: rng.choice(POOL),
                            lambda: ("OpPartition", rng.choice(POOL), rng.choice(POOL)),
                            lambda: ("OpPartition", rng.choice([0, 1]), rng.choice([0, 1, -1, 3]))])()
    return {"partition": partition, "recompute_id": rng.choice([-1, -1, 0, -2, True, "0", 1.5]),
            "stage_id": rng.choice([-1, -1, 0, -3, None]), "pre_hook": rng.choice([None, None, print, 3, "f"]),
            "mesh_dim": rng.choice([None, None, "tp", 1, "1x", ""])}


def plan_invalid(args: dict) -> bool:
    """What the field checks must refuse (ranges against the op's shapes are build_plan's to check)."""
    p = args["partition"]
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if isinstance(p, tuple) and p and p[0] == "OpPartition":
        bad_partition = not (is_int(p[1]) and p[1] >= 0 and is_int(p[2]))
    else:
        bad_partition = p not in ("auto", None)
    return (bad_partition or not (is_int(args["recompute_id"]) and args["recompute_id"] >= -1)
            or not (is_int(args["stage_id"]) and args["stage_id"] >= -1)
            or args["pre_hook"] not in (None, print) or args["mesh_dim"] not in (None, "tp"))


class TimedOut(Exception):
    pass


def run(fn, limit_s: float):
    def expire(signum, frame):
        raise TimedOut

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    start = time.perf_counter()
    try:
        fn()
        outcome = "accepted"
    except PolicyError:
        outcome = "PolicyError"
    except TimedOut:
        outcome = f"ran past {limit_s:g} s"
    except BaseException as exc:  # noqa: BLE001  (counting what escapes is the point)
        outcome = type(exc).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return outcome, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--yaml", type=int, default=4000)
    parser.add_argument("--plans", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-s", type=float, default=2.0)
    args = parser.parse_args()
    print(f"dtensor_ext from {dtensor_ext.__file__}")
    rng = random.Random(args.seed)
    counts, silent, slowest = collections.Counter(), collections.Counter(), 0.0
    for _ in range(args.yaml):
        text = yaml_input(rng)
        outcome, took = run(lambda: parse_constraints(text), args.limit_s)
        counts["yaml", outcome] += 1
        slowest = max(slowest, took)
        if outcome == "accepted" and not parse_constraints(text):
            silent["yaml: empty document accepted"] += 1
        if outcome == "accepted" and any(c.isdigit() and not c.isascii() for c in text):
            silent["yaml: accepted with non-ASCII digits somewhere (op names included)"] += 1
    torch.manual_seed(0)
    model, x = MoEModel(), torch.randn(6, 8)
    with simulated_mesh(2) as mesh:
        for _ in range(args.plans):
            plan_args = plan_input(rng)

            def construct_and_build():
                kwargs = dict(plan_args)
                if isinstance(kwargs["partition"], tuple) and kwargs["partition"][:1] == ("OpPartition",):
                    kwargs["partition"] = OpPartition(*kwargs["partition"][1:])
                build_plan(model, mesh, (x,), policy=lambda graph, cfg: iter([OpPlan(graph.nodes[0], **kwargs)]))

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PlanWarning)
                outcome, _ = run(construct_and_build, args.limit_s)
            counts["plans", outcome] += 1
            if outcome == "accepted" and plan_invalid(plan_args):
                silent["plans: invalid field accepted"] += 1
    for (kind, outcome), n in sorted(counts.items()):
        print(f"{kind:6s} {outcome:22s} {n}")
    others = sum(n for (kind, outcome), n in counts.items() if outcome not in ("accepted", "PolicyError"))
    print(f"not PolicyError (other exception or time limit): {others} of {args.yaml + args.plans}")
    for what, n in sorted(silent.items()):
        print(f"silently accepted, {what}: {n}")
    print(f"slowest YAML input: {slowest:.3f} s")


if __name__ == "__main__":
    main()
