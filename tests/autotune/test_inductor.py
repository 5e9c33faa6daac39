"""Collective autotuning inside Inductor on real gloo ranks: a user's custom collective op with two alternative
implementations, compiled with inductor while the package's benchmarker is installed. Every rank must pick the same
implementation, a second compile must reuse the recorded decisions without benchmarking, and a rank that fails or
stalls (before the start barrier, or between two collectives of a timed run) must send everyone to the default
without a hang (the outer timeout of ranks.py kills a hung test).

The implementations use only out-of-place functional collectives and a custom op (the fault point), so Inductor
generates no C++ kernel (a C++ build takes tens of seconds on a loaded 2-core box).
"""

import json
import logging
import math
import re

import pytest
import torch  # at module scope: the custom ops' annotations name it

from dtensor_ext.testing.ranks import run_ranks

TIMEOUT_S = 3.0  # the benchmarker's start-barrier, agreement and shadow-group timeout in the fault cases
STALL_S = TIMEOUT_S + 2.0
CALM_TIMEOUT_S = 60.0  # without a fault: ranks reach a choice seconds apart on a loaded box, and nothing stalls


def compile_with_autotuning(rank: int, fault: str, calibration: str) -> dict:
    """Compile the op with the benchmarker, rank 1 faulty as ``fault`` says while the first choice is benchmarked
    ("raise"/"stall": compiling it, before the start barrier; "raise_inside"/"stall_inside": between the
    reduce_scatter and the all_gather of its first timed run). Without a fault, compile a second time (dynamo
    reset, a new benchmarker on the same calibration file) and count the choice runs it made."""
    import os
    import tempfile
    import time

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()  # nothing shared between ranks or tests
    import torch.distributed as dist

    from dtensor_ext import _compat
    from dtensor_ext.autotune.inductor import CollectiveBenchmarker, register_collective_autotuning

    c10d = torch.ops._c10d_functional
    group, world = dist.group.WORLD.group_name, dist.get_world_size()
    armed = []  # the fault the next fault point injects

    @torch.library.custom_op("dtensor_ext_test::fault_point", mutates_args=())
    def fault_point(x: torch.Tensor) -> torch.Tensor:
        if armed:
            if armed.pop() == "raise":
                raise RuntimeError("injected fault between collectives")
            time.sleep(STALL_S)
        return x.clone()

    @fault_point.register_fake
    def _(x):
        return torch.empty_like(x)

    @torch.library.custom_op("dtensor_ext_test::sum_over_ranks", mutates_args=())
    def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))

    @sum_over_ranks.register_fake
    def _(x):
        return torch.empty_like(x)

    def reduce_scatter_all_gather(x, reduce_op="sum"):
        shard = fault_point(c10d.wait_tensor(c10d.reduce_scatter_tensor(x, reduce_op, world, group)))
        return c10d.wait_tensor(c10d.all_gather_into_tensor(shard, world, group))

    def twice(x):  # the max over ranks of equal tensors changes nothing: the same values, twice the collectives
        return reduce_scatter_all_gather(reduce_scatter_all_gather(x), "max")

    register_collective_autotuning(sum_over_ranks, {"rs_ag": reduce_scatter_all_gather, "rs_ag_twice": twice})
    timeout_s = CALM_TIMEOUT_S if fault == "none" else TIMEOUT_S
    benchmarker = CollectiveBenchmarker(timeout_s=timeout_s, warmup=1, runs=5, calibration=calibration)

    store = _compat.default_store()
    runs = []  # one entry per call of a choice by the benchmarker

    def inject(prepare, run, choice, fingerprint, inputs):
        """The benchmarker, with rank 1 faulty while the first choice is benchmarked. The compile stall starts
        once every other rank is about to enter the start barrier, so that it outlasts their timeout however
        unevenly the ranks compiled."""
        first = not benchmarker.decisions

        def faulty_prepare():
            if rank == 1 and first and fault == "raise":
                raise RuntimeError("injected compile failure")
            prepare()
            if first and fault == "stall":
                if rank != 1:
                    store.set(f"test/compiled/{rank}", "1")
                else:
                    store.wait([f"test/compiled/{r}" for r in range(world) if r != 1])
                    time.sleep(STALL_S)

        def counted_run():
            runs.append(choice)
            if rank == 1 and first and len(runs) == 2 and fault.endswith("_inside"):  # the first timed run
                armed.append(fault.removesuffix("_inside"))
            run()

        return benchmarker(faulty_prepare, counted_run, choice, fingerprint, inputs)

    x = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16) * (rank + 1)
    expected = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16) * sum(range(1, world + 1))

    def compile_and_run(benchmark) -> tuple[bool, list[str]]:
        undo = _compat.set_collective_choice_benchmark(benchmark)
        try:
            compiled = torch.compile(sum_over_ranks, backend="inductor", fullgraph=True)
            first = compiled(x)
        finally:
            undo()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            second = compiled(x)
        ran = sorted(e.name for e in prof.events() if e.name.startswith("gloo:"))
        return torch.equal(first, expected) and torch.equal(second, expected), ran

    exact, ran = compile_and_run(inject)
    result = {"exact": exact, "decisions": [tuple(vars(d).values()) for d in benchmarker.decisions],
              "collectives_run": ran, "choice_runs": len(runs)}
    benchmarker.uninstall()  # drops its shadow groups
    if fault == "none":
        torch._dynamo.reset()
        runs.clear()
        benchmarker = CollectiveBenchmarker(timeout_s=timeout_s, warmup=1, runs=5, calibration=calibration)
        exact, ran = compile_and_run(inject)
        result["again"] = {"exact": exact, "decisions": [tuple(vars(d).values()) for d in benchmarker.decisions],
                           "collectives_run": ran, "choice_runs": len(runs)}
    return result


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
def test_every_rank_picks_the_same_fastest_implementation_and_a_second_compile_reuses_it(world, tmp_path):
    calibration = tmp_path / "cal.json"
    results = run_ranks(compile_with_autotuning, "none", str(calibration), world=world, timeout_s=240)
    decisions, ran = _check_same_everywhere(results)
    assert sorted(_implementation(label) for label, *_ in decisions) == ["fallback", "rs_ag", "rs_ag_twice"]
    assert all(math.isfinite(ms) and reason is None and not recorded for _, ms, reason, recorded in decisions)
    assert all(r["choice_runs"] == 3 * (1 + 5) for r in results.values())  # warm-up + timed runs per choice
    fastest = min(decisions, key=lambda d: d[1])[0]
    assert ran == RUNS[_implementation(fastest)], f"fastest {fastest} but the step ran {ran}"
    entry = json.loads(calibration.read_text())["entries"][f"gloo/cpu/mesh={world}/float32"]
    recorded = {key: (c["median_s"], c["fallback"]) for key, c in entry["choices"].items()}
    assert recorded == {f"inductor/{label}": (ms / 1e3, False) for label, ms, _, _ in decisions}
    assert all(label.endswith("/inputs=64x16") and "@" in entry["choices"][f"inductor/{label}"]["implementation"]
               for label, *_ in decisions)
    # The second compile (dynamo reset, a new benchmarker on the same file): rank 0's records decide, every rank
    # hands Inductor the same times, no choice runs anywhere, and the step runs the same implementation.
    again, _ = _check_same_everywhere({rank: r["again"] for rank, r in results.items()})
    assert again == [(label, ms, None, True) for label, ms, _, _ in decisions]
    assert all(r["again"]["choice_runs"] == 0 for r in results.values())
    assert results[0]["again"]["collectives_run"] == ran


@pytest.mark.parametrize(("world", "fault", "reason"), [
    (2, "raise", "failed: rank 1 raised RuntimeError compiling it"),
    (2, "stall", "failed: ranks [1] did not arrive in time"),
    (4, "stall", "failed: ranks [1] did not arrive in time"),
    (2, "raise_inside", "failed: rank 1 raised RuntimeError running it: injected fault between collectives"),
    # rank 0 waits in the all_gather on its shadow group, which times out after TIMEOUT_S
    (2, "stall_inside", r"failed: rank 0 raised RuntimeError running it: .*Timed out waiting 3000ms for .*"),
])
def test_a_failing_or_stalled_rank_sends_every_rank_to_the_default(world, fault, reason, tmp_path):
    calibration = tmp_path / "cal.json"
    results = run_ranks(compile_with_autotuning, fault, str(calibration), world=world, timeout_s=240)
    decisions, ran = _check_same_everywhere(results)
    assert len(decisions) == 1 and decisions[0][1] == math.inf, decisions
    assert re.fullmatch(reason if fault == "stall_inside" else re.escape(reason), decisions[0][2]), decisions
    assert _implementation(decisions[0][0]) == "rs_ag"  # Inductor asks no more after a collective choice failed
    assert ran == RUNS["fallback"]  # on the job's own group, which the faulty benchmark never touched
    entry = json.loads(calibration.read_text())["entries"][f"gloo/cpu/mesh={world}/float32"]
    (only,) = entry["choices"].values()
    assert only["fallback"] and only["reason"] == decisions[0][2] and only["median_s"] == -1.0


# Reading records back, without ranks: what is reused and what is ignored.

def _record(path, implementation="c@abc", median_s=0.002, fallback=False):
    from dtensor_ext.autotune import CalibrationEntry, Choice, write_calibration_entry

    write_calibration_entry(path, "gloo/cpu/mesh=2/float32", CalibrationEntry(
        {}, {"inductor/c/inputs=8": Choice(implementation, median_s, fallback, "why" if fallback else None)}))


def _lookup(path, implementation="c@abc"):
    from dtensor_ext.autotune.inductor import CollectiveBenchmarker

    return CollectiveBenchmarker(calibration=path)._lookup("gloo/cpu/mesh=2/float32", "c/inputs=8", implementation)


def test_a_record_of_the_same_choice_is_reused(tmp_path):
    _record(tmp_path / "cal.json")
    assert _lookup(tmp_path / "cal.json") == 0.002
    assert _lookup(tmp_path / "absent.json") is None


@pytest.mark.parametrize(("case", "warned"), [
    ("another version of the choice", "stale"), ("a recorded fallback", None), ("not JSON", "not valid JSON"),
])
def test_an_untrusted_record_is_ignored(case, warned, tmp_path, caplog):
    path = tmp_path / "cal.json"
    if case == "not JSON":
        path.write_text("{truncated")
    else:
        _record(path, fallback=case == "a recorded fallback")
    with caplog.at_level(logging.INFO, logger="dtensor_ext.autotune.inductor"):
        assert _lookup(path, "c@def" if case.startswith("another") else "c@abc") is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (warned is None and not warnings) or (len(warnings) == 1 and warned in warnings[0]), warnings


def test_an_unreadable_file_is_left_as_it_was(tmp_path, caplog):
    from dtensor_ext.autotune import Choice
    from dtensor_ext.autotune.inductor import CollectiveBenchmarker

    path = tmp_path / "cal.json"
    path.write_text("{truncated")
    with caplog.at_level(logging.WARNING, logger="dtensor_ext.autotune.inductor"):
        CollectiveBenchmarker(calibration=path)._record("k", "c/inputs=8", Choice("c@abc", 0.001, False, None))
    assert path.read_text() == "{truncated"
    assert any("left as it was" in r.getMessage() for r in caplog.records)


def test_timeout_must_be_positive():
    from dtensor_ext.autotune.inductor import CollectiveBenchmarker

    with pytest.raises(ValueError, match=r"field 'timeout_s' got 0; expected a finite number > 0"):
        CollectiveBenchmarker(timeout_s=0)
