"""`loraweave serve`: the Ray Serve application of `loraweave.serve` from the command line."""

from __future__ import annotations

import argparse
import sys
import time

from ..errors import ArgumentError
from .support import EXIT_INTERRUPTED, integer_arg


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..tools.generate import GenerateRequest, validate

    if not Path(args.lora_dir).is_dir():
        raise ArgumentError(f"--lora-dir {args.lora_dir}: no such folder")
    validate(
        GenerateRequest(model=args.model, prompt="")
    )  # a missing or non-pipeline --model fails here, not in Ray
    try:
        import ray
        from ray import serve

        from ..serve import start
        from ..serve.app import ServeOptions
    except ImportError as exc:
        raise ArgumentError(
            f"loraweave serve needs Ray Serve: pip install 'loraweave[serve]' ({exc})"
        ) from None
    options = ServeOptions(
        model=args.model,
        lora_dir=args.lora_dir,
        replicas=args.replicas,
        max_adapters_per_replica=args.max_adapters_per_replica,
        max_batch=args.max_batch,
        batch_wait_s=args.batch_wait_ms / 1000,
        threads=args.threads,
    )
    _, url = start(options, address=args.address, port=args.port)
    print(f"serving on {url}/ (POST JSON requests; GET {url}/health); Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("shutting down", file=sys.stderr, flush=True)
        serve.shutdown()
        ray.shutdown()
        return EXIT_INTERRUPTED


def add(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a pipeline with many adapters over HTTP (Ray Serve; pip install loraweave[serve])",
        description="Deploy a diffusers pipeline and a folder of LoRAs with Ray Serve. POST a JSON object "
        "{prompt (may hold <lora:NAME:W> tags), negative, adapters: [{name, strength}], steps, cfg, seed, "
        "width, height}; the answer is {png_b64, report (per adapter), metrics (queue_s, batch_size, "
        "adapter_load hit/miss, replica)}. Requests for the same adapters go to replicas that hold them "
        "(multiplexing, LRU per replica); requests arriving together are rendered in one batch, each sample "
        "with its own adapters. Unknown names, paths outside --lora-dir and adapters that do not fully land "
        "on the model get HTTP 400/422.",
        epilog="for serve: 130 after Ctrl-C (the application and a Ray instance it started are shut down); "
        "2 = bad arguments, a missing model or folder, or Ray Serve not installed.",
    )
    p.add_argument("--model", "-m", required=True, help="diffusers pipeline folder")
    p.add_argument(
        "--lora-dir", required=True, help="folder of .safetensors adapters (names as in <lora:NAME> tags)"
    )
    p.add_argument(
        "--replicas", type=integer_arg("--replicas", 1, 1024), default=1, help="renderer replicas (default 1)"
    )
    p.add_argument(
        "--port", type=integer_arg("--port", 1, 65535), default=8000, help="HTTP port (default 8000)"
    )
    p.add_argument(
        "--max-adapters-per-replica",
        type=integer_arg("--max-adapters-per-replica", 1, 1024),
        default=8,
        help="adapters resident per replica (LRU; default 8)",
    )
    p.add_argument(
        "--max-batch",
        type=integer_arg("--max-batch", 1, 1024),
        default=8,
        help="requests per batch (default 8; 1: no batching)",
    )
    p.add_argument(
        "--batch-wait-ms",
        type=integer_arg("--batch-wait-ms", 1, 60_000),
        default=50,
        help="how long a batch waits to fill (default 50)",
    )
    p.add_argument(
        "--threads",
        type=integer_arg("--threads", 1, 1024),
        help="torch threads per replica (default: torch's count here, what `generate` uses: equal counts "
        "give images equal to generate's; with several replicas on one machine give each a share)",
    )
    p.add_argument(
        "--address", help="join this Ray cluster (e.g. ray://head:10001 or auto) instead of starting one"
    )
