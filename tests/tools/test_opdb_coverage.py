"""`coverage --opdb` classifies ops correctly: fixed by a rule, WRONG under a bad rule, excluded, and its JSON."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import signal

import pytest
import torch

import dtensor_ext
from dtensor_ext import _compat
from dtensor_ext.__main__ import main
from dtensor_ext._compat import Partial, Replicate, Shard, TorchDispatchMode
from dtensor_ext.tools.opdb_coverage import (
    Options, _in_child_process, _place_exactly, excluded_reason, format_report, measure, merge,
)

ONE_D = ("1d4",)


def _statuses(result, mesh, mode):
    return {label: status for status, labels in result["results"][mesh][mode]["ops"].items() for label in labels}


def test_op_torch_lacks_fails_without_package_and_is_fixed_by_its_family():
    result = measure(Options(ops=["addbmm"], max_samples=2, max_shardings=6))
    for mesh in ("1d4", "2x2"):
        assert _statuses(result, mesh, "without")["addbmm"] == "no_strategy"
        assert _statuses(result, mesh, "with")["addbmm"] == "correct"
    assert result["fixed_by_family"] == {"matmul": ["addbmm"]}
    assert result["broken_by_package"] == []
    assert dtensor_ext.is_installed()  # the run puts the package back as it found it


def _wrong_mv_rule():
    """mv with the matrix sharded on k and the vector on k claims a Replicate output; the truth is Partial."""
    return _torch_rule(torch.ops.aten.mv.default, lambda op, args, kwargs: [[Replicate(), Shard(1), Shard(0)]])


@contextlib.contextmanager
def _torch_rule(op, rule):
    """`rule` placed in torch's own table for `op` (so install() leaves it alone) for the duration."""
    dtensor_ext.uninstall()
    before = _compat.snapshot_registration(op)
    _compat.register_single_dim(op, rule)
    _compat.clear_sharding_caches()
    try:
        yield
    finally:
        _compat.restore_registration(op, before)
        _compat.clear_sharding_caches()
        dtensor_ext.install()


def test_a_wrong_rule_is_counted_as_wrong_and_fails_the_command():
    with _wrong_mv_rule():
        result = measure(Options(ops=["mv"], max_samples=1, max_shardings=12, meshes=ONE_D))
        with contextlib.redirect_stdout(io.StringIO()):
            status = main(["coverage", "--opdb", "--ops", "mv", "--max-samples", "1", "--max-shardings", "12",
                           "--meshes", "1d4"])
    for mode in ("without", "with"):  # the bad rule sits in torch's table, so install() leaves it alone
        assert result["results"]["1d4"][mode]["ops"]["wrong"] == ["mv"]
        assert "ranks hold different values" in result["results"]["1d4"][mode]["examples"]["mv"]["wrong"]
    assert status == 1
    assert "ops WRONG (result differs)                  1        1" in format_report(result)


def test_communication_where_a_local_strategy_exists_is_reported():
    # a replicate-only mv rule makes DTensor gather sharded inputs although mv could run on each rank's pieces
    with _torch_rule(torch.ops.aten.mv.default, lambda op, args, kwargs: []):
        result = measure(Options(ops=["mv"], max_samples=1, max_shardings=20, meshes=ONE_D))
    assert _statuses(result, "1d4", "without")["mv"] == "correct"
    assert result["results"]["1d4"]["without"]["communicated_although_local_possible"] == ["mv"]
    assert result["results"]["1d4"]["without"]["examples"]["mv"]["communicated"].startswith("sample 0 [(")


def test_no_local_check_skips_the_probe_and_says_so():
    with _torch_rule(torch.ops.aten.mv.default, lambda op, args, kwargs: []):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(["coverage", "--opdb", "--json", "--ops", "mv", "--max-samples", "1", "--max-shardings", "20",
                  "--meshes", "1d4", "--no-local-check"])
    result = json.loads(out.getvalue())
    assert result["options"]["local_check"] is False
    assert result["results"]["1d4"]["without"]["communicated_although_local_possible"] == []
    assert "communicating where local" not in format_report(result)


def test_the_communication_free_probe_survives_kernels_that_crash_on_mismatched_pieces():
    """segment_reduce trusts its offsets: DTensor gathers the sharded data and the run is correct, then the probe
    runs the kernel on a data shard with the whole offsets, which reads out of bounds and (in one process) used to
    kill the measurement with SIGSEGV. The probe runs in a fork now; the crash counts as no valid local layout."""
    with _torch_rule(torch.ops.aten.segment_reduce.default, lambda op, args, kwargs: []):
        result = measure(Options(ops=["_segment_reduce.offsets"], max_samples=4, max_shardings=8, meshes=ONE_D))
    assert result["results"]["1d4"]["without"]["runs"]["correct"] > 0
    assert result["results"]["1d4"]["without"]["communicated_although_local_possible"] == []


def test_probe_child_reports_its_answer_a_crash_and_an_exception():
    assert _in_child_process(lambda: True) is True
    assert _in_child_process(lambda: False) is False
    assert _in_child_process(lambda: os.kill(os.getpid(), signal.SIGSEGV)) is None
    with pytest.raises(RuntimeError, match="probe raised in its child process"):
        _in_child_process(lambda: 1 / 0)


def test_an_op_calling_one_module_twice_is_measured():
    # triplet_margin_with_distance_loss calls its distance module twice; torch's CommDebugMode fails on that
    result = measure(Options(ops=["nn.functional.triplet_margin_with_distance_loss"], max_samples=1,
                             max_shardings=2, meshes=ONE_D))
    assert result["results"]["1d4"]["with"]["runs"] == {"correct": 2}


def test_excluded_classes_are_listed_and_not_run():
    assert excluded_reason("nonzero") == "data-dependent output shape"
    assert excluded_reason("nn.functional.dropout2d") == "random"
    assert excluded_reason("as_strided_scatter") == "as_strided"
    assert excluded_reason("add") is None
    result = measure(Options(ops=["nonzero", "add"], max_samples=1, max_shardings=1, meshes=ONE_D))
    assert result["excluded"] == {"nonzero": "data-dependent output shape"}
    assert result["ops_measured"] == 1
    assert sum(result["skipped_samples"].values()) > 0  # samples past the cap are counted, not dropped


def test_exclusions_by_name_rest_on_torch_facts():
    """Ops excluded by name beyond the obvious ones: torch itself says their output shape is data-dependent, or
    they draw random numbers, or they call as_strided."""
    aten = torch.ops.aten
    for label, op in [("linalg.lstsq", aten.linalg_lstsq.default), ("nn.functional.ctc_loss", aten._ctc_loss.default)]:
        assert excluded_reason(label) == "data-dependent output shape"
        assert torch.Tag.dynamic_output_shape in op.tags, op

    def dispatched(run) -> set:
        calls = set()

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                calls.add(func)
                return func(*args, **(kwargs or {}))

        with Record():
            run()
        return calls

    a = torch.randn(6, 4)
    lowrank = [("svd_lowrank", lambda: torch.svd_lowrank(a, q=2)), ("pca_lowrank", lambda: torch.pca_lowrank(a, q=2))]
    for label, run in lowrank:
        assert excluded_reason(label) == "random"
        assert any(torch.Tag.nondeterministic_seeded in op.tags for op in dispatched(run)), label
    assert excluded_reason("stft") == "as_strided"
    assert aten.as_strided.default in dispatched(
        lambda: torch.stft(torch.randn(64), 16, window=torch.ones(16), return_complex=True)
    )


def test_tensor_split_is_measured_on_its_samples_without_tensor_split_points():
    result = measure(Options(ops=["tensor_split"], max_samples=2, max_shardings=2, meshes=ONE_D))
    assert result["skipped_samples"]["excluded: data-dependent output shape"] > 0  # the tensor-index samples
    assert result["samples_run"] == 2
    assert _statuses(result, "1d4", "with") == {"tensor_split": "correct"}


def test_getitem_is_measured_as_users_index():
    """x[[1, 2]] runs DTensor's __getitem__ (a fix turns the list into a replicated index); calling the base
    method torch.Tensor.__getitem__ directly, as the OpInfo's op would, skips it."""
    result = measure(Options(ops=["__getitem__"], max_samples=1, max_shardings=4, meshes=ONE_D))
    assert _statuses(result, "1d4", "with") == {"__getitem__": "correct"}
    assert _statuses(result, "1d4", "without") == {"__getitem__": "error"}


def test_json_output_has_the_documented_fields():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["coverage", "--opdb", "--json", "--ops", "add", "--max-samples", "1", "--max-shardings", "2"])
    result = json.loads(out.getvalue())
    assert status == 0
    assert set(result) == {
        "torch", "dtensor_ext", "options", "seconds", "ops_measured", "samples_run", "excluded", "skipped_samples",
        "shardings_not_run", "results", "fixed_by_family", "broken_by_package", "communication_vs_torch",
    }
    assert result["communication_vs_torch"]["2x2"] == {"differ": {}, "more_than_torch": []}
    assert set(result["results"]) == {"1d4", "2x2"}
    per_mode = result["results"]["2x2"]["with"]
    assert set(per_mode) == {"ops", "runs", "communicated_although_local_possible", "fallback_runs", "examples"}
    assert set(per_mode["ops"]) == {"wrong", "no_strategy", "error", "other", "correct", "untested"}
    assert per_mode["ops"]["correct"] == ["add"] and per_mode["runs"] == {"correct": 2}


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="meshes: unknown mesh '3d'"):
        measure(Options(ops=["add"], meshes=["3d"]))
    with pytest.raises(ValueError, match="ops: no OpInfo left"):
        measure(Options(ops=["no_such_op*"]))


@pytest.mark.parametrize("mesh_shape, placements", [((4,), (Partial("sum"),)), ((2, 2), (Partial("sum"), Shard(0))),
                                                    ((2, 2), (Partial("sum"), Partial("sum")))])
def test_partial_pieces_add_up_exactly_in_every_order(mesh_shape, placements):
    t = torch.randn(6, 3, generator=torch.Generator().manual_seed(0)) * 7
    coords = {r: c for r, c in enumerate(itertools.product(*(range(n) for n in mesh_shape)))}
    pieces = _place_exactly(t, placements, mesh_shape, coords)
    holders = [r for r in coords if all(coords[r][d] == 0 for d, p in enumerate(placements) if isinstance(p, Shard))]
    for order in itertools.permutations(holders):
        total = torch.zeros_like(pieces[order[0]])
        for r in order:
            total = total + pieces[r]
        assert torch.equal(total, t[: total.shape[0]])
    assert not torch.equal(pieces[holders[0]], t[: pieces[holders[0]].shape[0]])  # the value really is split


def test_getitem_samples_excluded_are_exactly_the_boolean_masks():
    """A boolean mask index is data-dependent: x[mask] holds as many rows as the mask has True values (DTensor
    runs nonzero for it). Every other __getitem__ sample (ints, slices, lists, integer index tensors) is measured."""
    from dtensor_ext._compat import opinfo_db
    from dtensor_ext.tools.opdb_coverage import EXCLUDED_SAMPLES

    in_class, why = EXCLUDED_SAMPLES["__getitem__"]
    assert why == "data-dependent output shape"
    info = next(i for i in opinfo_db() if i.name == "__getitem__")
    excluded = 0
    for sample in info.sample_inputs("cpu", torch.float32):
        (index,) = sample.args
        if not in_class(sample):
            assert not (isinstance(index, torch.Tensor) and index.dtype == torch.bool), index
            continue
        excluded += 1
        assert isinstance(index, torch.Tensor) and index.dtype == torch.bool
        for mask in (index, ~index, torch.ones_like(index)):
            assert sample.input[mask].shape[0] == int(mask.sum())
    assert excluded > 0


def test_merged_runs_count_as_one_run_over_all_their_ops():
    def run(ops):
        return measure(Options(ops=ops, max_samples=2, max_shardings=3, meshes=("1d4", "2x2")))

    parts = [run(["abs"]), run(["nn.functional.pad.constant", "mv"])]
    merged = merge(parts)
    assert merged.pop("seconds") == round(sum(p["seconds"] for p in parts), 1)
    whole = run(["abs", "nn.functional.pad.constant", "mv"])
    whole.pop("seconds")
    whole["options"]["ops"] = sorted(whole["options"]["ops"])
    assert merged == {**whole, "options": {**whole["options"], "local_check": True}}


def test_merge_refuses_overlapping_or_unlike_runs():
    one = measure(Options(ops=["abs"], max_samples=1, max_shardings=1, meshes=ONE_D))
    with pytest.raises(ValueError, match="op 'abs' is in result 0 and result 1"):
        merge([one, one])
    other = measure(Options(ops=["neg"], max_samples=1, max_shardings=2, meshes=ONE_D))
    with pytest.raises(ValueError, match="options.max_shardings 2"):
        merge([one, other])


def test_merge_of_runs_with_different_sample_caps_counts_what_the_lower_cap_left_out():
    capped = measure(Options(ops=["add"], max_samples=1, max_shardings=1, meshes=ONE_D))
    assert capped["skipped_samples"]["sample cap"] > 0
    merged = merge([capped, measure(Options(ops=["neg"], max_samples=1000, max_shardings=1, meshes=ONE_D))])
    assert merged["options"]["max_samples"] == 1000
    assert merged["skipped_samples"]["sample cap"] == capped["skipped_samples"]["sample cap"]


def test_samples_drawing_random_numbers_are_skipped_even_when_two_draws_agree():
    """multi_head_attention_forward with training=True runs dropout: a sample whose two single-device draws happen
    to agree must not be judged (the sharded run draws again)."""
    from collections import Counter

    from dtensor_ext.tools.opdb_coverage import _cases, _selected_opinfos

    (info,), _ = _selected_opinfos(Options(ops=["nn.functional.multi_head_attention_forward"]))
    skipped = Counter()
    kept = _cases(info, Options(max_samples=1000), skipped)
    assert skipped["draws random numbers"] > 0
    assert not any("bernoulli" in name for case in kept for name in case.dispatched)


def test_a_sample_keeps_its_values_when_the_generator_edits_them_for_the_next_one():
    """masked.sum's sample generator writes NaN into a tensor it already yielded; the stored case must still hold
    the values its single-device result was computed from."""
    from collections import Counter

    from dtensor_ext.tools.opdb_coverage import _cases, _selected_opinfos

    (info,), _ = _selected_opinfos(Options(ops=["masked.sum"]))
    for case in _cases(info, Options(max_samples=1000), Counter()):
        again = case.call([t.clone() for t in case.tensors])
        torch.testing.assert_close(again, case.expected, equal_nan=True, msg=f"sample {case.index}")


def test_communication_against_torch_alone_is_reported_per_op():
    """Collectives and payload bytes of the runs correct both ways, torch alone against the package, per op; the
    rules that moved more than torch's own path (aminmax and pairwise_distance's norm gathered a reduced dim that
    torch leaves Partial) move no more now."""
    result = measure(Options(ops=["aminmax", "nn.functional.pairwise_distance", "add"], max_samples=4,
                             max_shardings=6))
    comm = result["communication_vs_torch"]
    for mesh in ("1d4", "2x2"):
        # an op is listed as moving more exactly where the package's runs moved more collectives or payload bytes
        for op, measured in comm[mesh]["differ"].items():
            more = measured["collectives"][1] > measured["collectives"][0] or measured["bytes"][1] > measured["bytes"][0]
            assert (op in comm[mesh]["more_than_torch"]) == more, (mesh, op, measured)
        assert "add" not in comm[mesh]["differ"]  # torch's own strategy either way
        assert comm[mesh]["more_than_torch"] == [], (mesh, comm[mesh]["differ"])
    assert {op for m in ("1d4", "2x2") for op in result["results"][m]["with"]["ops"]["correct"]} == {
        "aminmax", "nn.functional.pairwise_distance", "add"}
    assert "ops moving more than torch alone (runs correct both ways): 0" in format_report(result)


def _opinfo_or_skip(label: str) -> list:
    """The OpInfo named `label`; skips where this torch has none (2.11 has no linear_cross_entropy)."""
    from dtensor_ext.tools.opdb_coverage import _selected_opinfos

    infos, _ = _selected_opinfos(Options(ops=[label]))
    if not infos:
        pytest.skip(f"this torch has no OpInfo {label}")
    return infos


def _both_ways(label: str, index: int, mesh_name: str, placements) -> dict[str, tuple]:
    """(outcome, reason, (collectives, payload bytes, received bytes)) of one OpInfo sample under one input
    sharding, torch alone and with the package, exactly as the sweep runs it."""
    from collections import Counter

    from dtensor_ext.testing.mesh import rank_coordinates, simulated_mesh
    from dtensor_ext.tools.opdb_coverage import MESHES, _cases, _run_sharded, _set_package

    (info,) = _opinfo_or_skip(label)
    (case,) = [c for c in _cases(info, Options(max_samples=index + 1), Counter()) if c.index == index]
    ran = {}
    try:
        for mode in ("without", "with"):
            _set_package(mode)
            with simulated_mesh(MESHES[mesh_name]) as mesh:
                outcome, reason, _, moved = _run_sharded(case, placements, mesh, rank_coordinates(mesh),
                                                         Options(check_fallback=False))
            ran[mode] = (outcome, reason, moved)
    finally:
        dtensor_ext.install()
    return ran


R, P = Replicate(), Partial("sum")
# Runs of the full sweep (4 samples, 4 input shardings) where the package moved more than torch alone before its
# rules offered what torch's decomposition did: (OpInfo, sample, mesh, input placements)
_ONCE_WORSE = [
    ("addmv", 2, "2x2", [(Shard(0), Shard(0)), (R, Shard(0)), (Shard(0), Shard(0))]),  # broadcast bias [1]
    ("addmv", 3, "2x2", [(P, R), (Shard(1), P), (R, R)]),
    ("isin", 0, "1d4", [(P,), (Shard(0),)]),  # the test set split: Partial(max)
    ("isin", 0, "2x2", [(Shard(0), R), (R, Shard(0))]),
    ("nn.functional.pixel_shuffle", 0, "2x2", [(Shard(2), Shard(3))]),  # H and W sharded, chunks aligned
    ("nn.functional.pixel_shuffle", 1, "2x2", [(Shard(0), Shard(3))]),
    ("nn.functional.pixel_shuffle", 0, "1d4", [(Shard(1),)]),
    ("nn.functional.pixel_unshuffle", 0, "1d4", [(Shard(2),)]),
    ("polar", 1, "1d4", [(P,), (R,)]),  # polar is linear in abs: Partial abs, replicated angle
    ("polar", 3, "2x2", [(Shard(1), P), (R, R)]),
]


@pytest.mark.parametrize("label, index, mesh_name, placements", _ONCE_WORSE,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in _ONCE_WORSE])
def test_ops_once_worse_move_no_more_than_torch_alone(label, index, mesh_name, placements):
    ran = _both_ways(label, index, mesh_name, placements)
    if ran["without"][0] == "no_strategy":  # 2.11 alone has no polar strategy: nothing to compare against
        pytest.skip(f"torch alone has no strategy for {label} here")
    assert ran["without"][0] == ran["with"][0] == "correct", ran
    (c0, b0, _), (c1, b1, _) = ran["without"][2], ran["with"][2]
    assert c1 <= c0 and b1 <= b0, ran


def test_received_bytes_are_reported_beside_the_payload_and_not_judged():
    """Payload and received bytes can disagree: polar's 1d4 sample 2 on torch 2.13 before its Partial row, a
    Partial angle of 5 elements on 4 ranks all-reduced by torch alone (20 payload bytes, 30 received) and
    reduce-scattered by the package, padded to 8 elements (32 and 24), each after the same 20-byte all-gather (60
    received). Both are reported; the verdict reads collectives and payload, so more handed in is listed."""
    from dtensor_ext.tools.opdb_coverage import _communication_vs_torch, _OpRecord

    by_mode = {mode: {"polar": _OpRecord()} for mode in ("without", "with")}
    for mode, moved in (("without", (2, 40, 90)), ("with", (2, 52, 84))):
        by_mode[mode]["polar"].add("correct")
        by_mode[mode]["polar"].communication[2, "[(S(1)), (P)]"] = moved
    comm = _communication_vs_torch(["1d4"], {"polar": []}, {"1d4": by_mode})["1d4"]
    assert comm["differ"]["polar"] == {"runs": 1, "collectives": [2, 2], "bytes": [40, 52], "received_bytes": [90, 84]}
    assert comm["more_than_torch"] == ["polar"]
    ran = _both_ways("polar", 2, "1d4", [(Shard(1),), (P,)])
    assert ran["with"] == ("correct", None, (2, 52, 84)), ran  # what the sweep measures for that run


def test_a_malformed_output_piece_is_wrong_even_where_full_tensor_looks_right():
    """A rank holding a piece of another shape than its placements give it is WRONG, although full_tensor() (which
    trims each piece to its expected length) matches. torch 2.13 alone's addmv with a bias of shape [1] and 5
    matrix rows over 4 ranks does that (its kernel returns the bias's shape for an empty matrix; a sum then reads the
    junk element); the package moves the matrix off the empty piece instead."""
    from torch.distributed.tensor import DTensor

    from dtensor_ext._compat import LocalTensor
    from dtensor_ext.testing.mesh import simulated_mesh
    from dtensor_ext.tools.opdb_coverage import _compare

    junk = {0: torch.ones(2), 1: torch.ones(2), 2: torch.ones(1), 3: torch.ones(1)}  # Shard(0) of 5 gives rank 3 none
    with simulated_mesh((4,)) as mesh:
        for pieces, verdict in [(junk, ("wrong", "output 0: rank 3 holds a piece of shape (1,), its placements give "
                                                "(0,)")), ({**junk, 3: torch.ones(0)}, ("correct", None))]:
            out = DTensor.from_local(LocalTensor(pieces), mesh, [Shard(0)], run_check=False, shape=(5,), stride=(1,))
            assert _compare(out, torch.ones(5), mesh.mesh) == verdict
    ran = _both_ways("addmv", 3, "1d4", [(R,), (Shard(0),), (R,)])
    assert ran["with"][0] == "correct"
    if ran["without"][0] != "correct":  # torch 2.13 (2.15 alone gets it right)
        assert "rank 3 holds a piece of shape (1,), its placements give (0,)" in ran["without"][1]


# Extra samples (EXTRA_SAMPLES) whose rows carry unequal total target weight, batch-split: torch alone declares the
# mean loss Partial(avg) of the shards' means with no collective, which is right only for equal weights
_UNEQUAL_WEIGHT = [
    ("nn.functional.cross_entropy", 1000, "1d4", [(Shard(0),), (Shard(0),)]),  # an ignored target: a NaN shard
    ("nn.functional.cross_entropy", 1000, "2x2", [(Shard(0), R), (Shard(0), R)]),  # 2 shards of unequal count
    ("nn.functional.cross_entropy", 1001, "2x2", [(Shard(0), R), (Shard(0), R), (R, R)]),  # class weights
    ("nn.functional.nll_loss", 1000, "2x2", [(Shard(0), R), (Shard(0), R)]),
    ("nn.functional.linear_cross_entropy", 1000, "1d4", [(Shard(0),), (R,), (Shard(0),)]),
]


def _torch_alone_averages_shard_losses() -> bool:
    """Whether torch alone gives a batch-sharded mean nll_loss Partial(avg) with no collective (2.13; 2.15 gathers
    and is right): the defect these samples expose, probed on a tiny spec."""
    dtensor_ext.uninstall()
    try:
        scores = _compat.probe_spec(torch.zeros(4, 3), (Shard(0),))
        targets = _compat.probe_spec(torch.zeros(4, dtype=torch.long), (Shard(0),))
        out = _compat.output_placements(torch.ops.aten.nll_loss_forward.default, (scores, targets, None, 1, -100))
    finally:
        dtensor_ext.install()
    return out is not None and any(isinstance(p, Partial) for p in out)


@pytest.mark.parametrize("label, index, mesh_name, placements", _UNEQUAL_WEIGHT,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in _UNEQUAL_WEIGHT])
def test_torch_alone_is_wrong_where_shards_carry_unequal_target_weight(label, index, mesh_name, placements):
    """The sweep's extra samples make torch alone's mean-loss defect visible (so these ops leave "torch alone
    computes right"); the package's gather gives the right loss."""
    ran = _both_ways(label, index, mesh_name, placements)
    assert ran["with"][0] == "correct", ran
    assert (ran["without"][0] == "wrong") == _torch_alone_averages_shard_losses(), ran


@pytest.mark.parametrize("mesh_name", ["1d4", "2x2"])
def test_an_extra_samples_batch_split_is_always_run(mesh_name):
    """The sharding cap draws 4 of linear_cross_entropy.chunked's extra sample's 32 shardings on 1d4 and none splits
    the batch; the batch split is run as well, and torch alone is WRONG there (where it averages shard losses)."""
    from collections import Counter

    from dtensor_ext.tools.opdb_coverage import EXTRA_SAMPLE_INDEX, MESHES, _cases, _shardings

    label = "nn.functional.linear_cross_entropy.chunked"
    (info,) = _opinfo_or_skip(label)
    (case,) = [c for c in _cases(info, Options(max_samples=1), Counter()) if c.index == EXTRA_SAMPLE_INDEX]
    ndim = len(MESHES[mesh_name])
    skipped: Counter = Counter()
    picked = _shardings(case, mesh_name, ndim, 4, skipped)
    split = ((Shard(0),) * ndim, (R,) * ndim, (R,) * ndim)
    assert split in picked and len(picked) in (4, 5)
    assert skipped["sharding cap"] == (4 ** ndim) ** 2 * 2 ** ndim - len(picked)
    ran = _both_ways(label, EXTRA_SAMPLE_INDEX, mesh_name, list(split))
    assert ran["with"][0] == "correct", ran
    assert (ran["without"][0] == "wrong") == _torch_alone_averages_shard_losses(), ran


def test_extra_samples_are_measured_beyond_the_sample_cap():
    from collections import Counter

    from dtensor_ext.tools.opdb_coverage import EXTRA_SAMPLE_INDEX, _cases, _selected_opinfos

    (info,), _ = _selected_opinfos(Options(ops=["nn.functional.cross_entropy"]))
    indices = [c.index for c in _cases(info, Options(max_samples=1), Counter())]
    assert indices == [0, EXTRA_SAMPLE_INDEX, EXTRA_SAMPLE_INDEX + 1]


def test_an_op_torch_alone_gets_wrong_is_not_listed_as_moving_more():
    """cross_entropy's extra samples make torch alone WRONG on 2x2; the package's gather moves more over the runs
    correct both ways, but that is not "more than torch alone computing right"."""
    if not _torch_alone_averages_shard_losses():
        pytest.skip("this torch gathers a batch-sharded mean loss (right): it has no such defect to exclude")
    op = "nn.functional.cross_entropy"
    result = measure(Options(ops=[op], max_samples=2, max_shardings=6, meshes=["2x2"], check_fallback=False))
    assert op in result["results"]["2x2"]["without"]["ops"]["wrong"]
    assert op in result["results"]["2x2"]["with"]["ops"]["correct"] + result["results"]["2x2"]["with"]["ops"]["error"]
    comm = result["communication_vs_torch"]["2x2"]
    (c0, c1), (b0, b1) = comm["differ"][op]["collectives"], comm["differ"][op]["bytes"]
    assert c1 > c0 or b1 > b0, comm  # it moves more ...
    assert op not in comm["more_than_torch"], comm  # ... and is not listed
