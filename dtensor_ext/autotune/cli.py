"""``python -m dtensor_ext autotune --mesh 2,2`` under torchrun: tune, print the table, fits and plots.

gloo on CPU, nccl where CUDA is available. A one-rank mesh (``--mesh 1``) also runs without torchrun.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import sys

import torch
import torch.distributed as dist

from dtensor_ext.redistribute.calibration_file import dtype_name
from dtensor_ext.autotune.report import ascii_plots, format_report, svg_plots
from dtensor_ext.autotune.tuner import DEFAULT_SIZES, Autotuner
from dtensor_ext.tools.arguments import int_list, non_negative_int, output_file, positive_float, positive_int


def _dtype(text: str) -> str:
    try:
        return dtype_name(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a torch dtype name such as float32 or bfloat16") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", type=int_list, required=True, help="mesh shape, e.g. 2,2 (product = world size)")
    parser.add_argument("--sizes", type=int_list, default=DEFAULT_SIZES,
                        help="message sizes to time, bytes per rank, comma-separated (default: 4 KiB to 1 MiB)")
    parser.add_argument("--dtype", type=_dtype, default="float32", help="element type of the messages (default float32)")
    parser.add_argument("--warmup", type=non_negative_int, default=2,
                        help="untimed runs before the timed ones, per implementation and size (default 2)")
    parser.add_argument("--runs", type=positive_int, default=7,
                        help="timed runs per implementation and size (default 7)")
    parser.add_argument("--timeout", type=positive_float, default=30.0,
                        help="seconds any single wait may take before the tuner falls back (default 30)")
    parser.add_argument("--calibration", default="dtensor_ext_calibration.json",
                        help="calibration/cache file (default dtensor_ext_calibration.json)")
    parser.add_argument("--force", action="store_true", help="benchmark even when the cache has an entry")
    parser.add_argument("--svg", type=output_file, help="also write the time-vs-size plots to this SVG file")


def _init_process_group(mesh: tuple[int, ...]) -> None:
    world = math.prod(mesh)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    elif world == 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    else:
        raise SystemExit(f"mesh of {world} ranks: run under torchrun, e.g. "
                         f"torchrun --nproc-per-node {world} -m dtensor_ext autotune --mesh {','.join(map(str, mesh))}")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    _init_process_group(args.mesh)
    result = Autotuner(args.mesh, sizes=args.sizes, dtype=getattr(torch, args.dtype), warmup=args.warmup,
                       runs=args.runs, timeout_s=args.timeout, calibration_path=args.calibration,
                       force=args.force).tune()
    if dist.get_rank() == 0:
        print(format_report(result))
        print(f"calibration file: {os.path.abspath(args.calibration)}\n")
        print(ascii_plots(result) if result.measurements else "no plots: nothing was benchmarked (--force re-runs)")
        if args.svg and result.measurements:
            with open(args.svg, "w") as f:
                f.write(svg_plots(result))
            print(f"plots written to {args.svg}")
    sys.stdout.flush()
    if result.failure is None:  # a failed group may still hold a collective; tearing it down could block
        dist.destroy_process_group()
    return 1 if result.failure else 0
