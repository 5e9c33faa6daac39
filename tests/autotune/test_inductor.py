"""Collective autotuning inside Inductor on real gloo ranks: a user's custom collective op with two alternative
implementations, compiled with inductor while the package's benchmarker is installed. Every rank must pick the same
implementation, and a rank that fails or stalls must send everyone to the default without a hang (the outer
timeout of ranks.py kills a hung test).

The implementations use only out-of-place functional collectives, so Inductor generates no C++ kernel (a C++ build
takes tens of seconds on a loaded 2-core box).
"""

import json
import math

import pytest
import torch  # at module scope: the custom op's annotations name it

from tests.autotune.ranks import run_ranks

TIMEOUT_S = 3.0  # the benchmarker's start-barrier and agreement timeout
STALL_S = TIMEOUT_S + 2.0


def compile_with_autotuning(rank: int, fault: str, calibration: str) -> dict:
    import os
    import tempfile
    import time

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()  # nothing shared between ranks or tests
    import torch.distributed as dist

    from dtensor_ext import _compat
    from dtensor_ext.autotune.inductor import CollectiveBenchmarker, register_collective_autotuning

    c10d = torch.ops._c10d_functional
    group, world = dist.group.WORLD.group_name, dist.get_world_size()

    @torch.library.custom_op("dtensor_ext_test::sum_over_ranks", mutates_args=())
    def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))

    @sum_over_ranks.register_fake
    def _(x):
        return torch.empty_like(x)

    def reduce_scatter_all_gather(x, reduce_op="sum"):
        shard = c10d.wait_tensor(c10d.reduce_scatter_tensor(x, reduce_op, world, group))
        return c10d.wait_tensor(c10d.all_gather_into_tensor(shard, world, group))

    def twice(x):  # the max over ranks of equal tensors changes nothing: the same values, twice the collectives
        return reduce_scatter_all_gather(reduce_scatter_all_gather(x), "max")

    register_collective_autotuning(sum_over_ranks, {"rs_ag": reduce_scatter_all_gather, "rs_ag_twice": twice})
    benchmarker = CollectiveBenchmarker(timeout_s=TIMEOUT_S, warmup=1, runs=5, calibration=calibration)

    store = _compat.default_store()

    def inject(prepare, run, choice, inputs):
        """The benchmarker, with rank 1 failing or stalling while it compiles the first choice. The stall starts
        once every other rank is about to enter the start barrier, so that it outlasts their timeout however
        unevenly the ranks compiled."""
        def faulty_prepare():
            first = not benchmarker.decisions
            if rank == 1 and first and fault == "raise":
                raise RuntimeError("injected compile failure")
            prepare()
            if first and fault == "stall":
                if rank != 1:
                    store.set(f"test/compiled/{rank}", "1")
                else:
                    store.wait([f"test/compiled/{r}" for r in range(world) if r != 1])
                    time.sleep(STALL_S)

        return benchmarker(faulty_prepare, run, choice, inputs)

    undo = _compat.set_collective_choice_benchmark(inject)
    try:
        compiled = torch.compile(sum_over_ranks, backend="inductor", fullgraph=True)
        x = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16) * (rank + 1)
        first = compiled(x)
    finally:
        undo()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        second = compiled(x)
    ran = sorted(e.name for e in prof.events() if e.name.startswith("gloo:"))
    expected = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16) * sum(range(1, world + 1))
    return {"exact": torch.equal(first, expected) and torch.equal(second, expected),
            "decisions": benchmarker.decisions, "collectives_run": ran}


def _check_same_everywhere(results: dict) -> tuple[list, list]:
    decisions, ran = results[0]["decisions"], results[0]["collectives_run"]
    for rank, result in results.items():
        assert result["exact"], f"rank {rank}: the compiled op's values differ from the sum over ranks"
        assert result["decisions"] == decisions, f"rank {rank} saw other timings: {result['decisions']}"
        assert result["collectives_run"] == ran, f"rank {rank} ran {result['collectives_run']}, rank 0 {ran}"
    return decisions, ran


# What each implementation runs per call on gloo, as the profiler names it (gloo's reduce_scatter_tensor is an
# all_reduce underneath).
RUNS = {"rs_ag": ["gloo:all_gather", "gloo:all_reduce"],
        "rs_ag_twice": ["gloo:all_gather", "gloo:all_gather", "gloo:all_reduce", "gloo:all_reduce"],
        "fallback": ["gloo:all_reduce"]}


def _implementation(label: str) -> str:
    return next(name for name in ("rs_ag_twice", "rs_ag", "fallback") if name in label.split("/")[0])


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_picks_the_same_fastest_implementation(world, tmp_path):
    calibration = tmp_path / "cal.json"
    results = run_ranks(compile_with_autotuning, "none", str(calibration), world=world, timeout_s=240)
    decisions, ran = _check_same_everywhere(results)
    assert sorted(_implementation(label) for label, _, _ in decisions) == ["fallback", "rs_ag", "rs_ag_twice"]
    assert all(math.isfinite(ms) and reason is None for _, ms, reason in decisions), decisions
    fastest = min(decisions, key=lambda d: d[1])[0]
    assert ran == RUNS[_implementation(fastest)], f"fastest {fastest} but the step ran {ran}"
    entry = json.loads(calibration.read_text())["entries"][f"gloo/cpu/mesh={world}/float32"]
    recorded = {key: (c["median_s"], c["fallback"]) for key, c in entry["choices"].items()}
    assert recorded == {f"inductor/{label}": (ms / 1e3, False) for label, ms, _ in decisions}
    assert all(label.endswith("/inputs=64x16") for label, _, _ in decisions)


@pytest.mark.parametrize(("world", "fault", "reason"), [
    (2, "raise", "failed: rank 1 raised RuntimeError compiling it"),
    (2, "stall", "failed: ranks [1] did not arrive in time"),
    (4, "stall", "failed: ranks [1] did not arrive in time"),
])
def test_a_failing_or_stalled_rank_sends_every_rank_to_the_default(world, fault, reason, tmp_path):
    calibration = tmp_path / "cal.json"
    results = run_ranks(compile_with_autotuning, fault, str(calibration), world=world, timeout_s=240)
    decisions, ran = _check_same_everywhere(results)
    assert len(decisions) == 1 and decisions[0][1] == math.inf and decisions[0][2] == reason, decisions
    assert _implementation(decisions[0][0]) == "rs_ag"  # Inductor asks no more after a collective choice failed
    assert ran == RUNS["fallback"]
    entry = json.loads(calibration.read_text())["entries"][f"gloo/cpu/mesh={world}/float32"]
    (only,) = entry["choices"].values()
    assert only["fallback"] and only["reason"] == reason and only["median_s"] == -1.0
