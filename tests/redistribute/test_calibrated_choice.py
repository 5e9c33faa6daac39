"""The autotuner's calibration file changes the planner's choice where the measured links say so."""

from torch.distributed.tensor import Shard

from dtensor_ext.autotune import AlphaBeta, CalibrationEntry, calibration_key, write_calibration_entry
from dtensor_ext.redistribute import CalibratedCostModel, plan

MESH = (2, 2, 2)
SRC, DST = (Shard(0),) * 3, (Shard(1),) * 3


def _calibrate(path, backend, link):
    key = calibration_key(backend, "cpu", MESH, "float32")
    write_calibration_entry(path, key, CalibrationEntry(per_mesh_dim=dict.fromkeys(range(3), link), choices={}))
    return CalibratedCostModel.from_file(path, key)


def test_latency_bound_links_trade_bytes_for_fewer_hops(tmp_path):
    path = tmp_path / "calibration.json"
    # as fitted on an idle NVLink-like box vs the shared 2-core box's gloo (alpha 120-300 us in docs/autotune.md)
    low_latency = _calibrate(path, "nccl", AlphaBeta(alpha_s=1e-6, beta_s_per_byte=1e-9))
    high_latency = _calibrate(path, "gloo", AlphaBeta(alpha_s=2e-4, beta_s_per_byte=1e-9))

    flat = plan((1000, 1000), MESH, SRC, DST, cost_model=low_latency)
    staged = plan((1000, 1000), MESH, SRC, DST, cost_model=high_latency)

    assert [s.kind for s in flat.steps] == ["all_to_all"]  # one 8-way all-to-all: 7 hops, the byte lower bound
    assert [s.kind for s in staged.steps] == ["all_gather", "all_to_all"]  # 2 + 3 hops, twice the bytes
    assert staged.max_recv_bytes == 2 * flat.max_recv_bytes
