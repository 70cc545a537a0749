"""`loraweave serve` throughput: 32 requests over 8 adapters on the tiny SD1.5 pipeline
(tests/helpers/serve_fixtures.py), 8 steps, 64x64, one torch thread per replica, 2 replicas on local Ray,
measured side by side in one run:

  generate (sequential)   loraweave.tools.generate.generate per request (loads the pipeline each time, as the
                          CLI)
  engine (sequential)     loraweave.serve.Engine.run per request in this process: pipeline loaded once, no Ray
  serve max_batch=8       32 concurrent HTTP requests (8 client threads), batches mix adapters (Handle.batch)
  serve max_batch=1       the same without batching
  serve one at a time     max_batch=1, one request at a time: minus the engine's time = Ray's overhead per
                          request

Requests/s and p50/p95 latency (per request, client side). Needs `pip install loraweave[serve]`.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_serve.py [--requests 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers.serve_fixtures import build  # noqa: E402

ADAPTERS, CLIENTS = 8, 8
SETTINGS = {"steps": 8, "cfg": 5.0, "width": 64, "height": 64, "negative": "blurry"}


def bodies(n: int) -> list[dict]:
    return [
        {**SETTINGS, "prompt": f"request {i} <lora:a{i % ADAPTERS}:{0.5 + (i % 5) / 10}>", "seed": i}
        for i in range(n)
    ]


def summary(name: str, latencies: list[float], wall: float) -> dict:
    q = statistics.quantiles(latencies, n=20)
    row = {
        "variant": name,
        "requests_per_s": round(len(latencies) / wall, 2),
        "p50_s": round(statistics.median(latencies), 4),
        "p95_s": round(q[18], 4),
    }
    print(json.dumps(row), flush=True)
    return row


def timed(fn, items, clients: int = 1) -> tuple[list[float], float]:
    def one(item):
        start = time.perf_counter()
        fn(item)
        return time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        latencies = list(pool.map(one, items))
    return latencies, time.perf_counter() - start


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url + "/", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.loads(answer.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import ray
    from ray import serve

    from loraweave.serve import Engine, start
    from loraweave.serve.app import ServeOptions
    from loraweave.tools.generate import GenerateRequest, generate

    tmp = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    pipe_dir, loras = build(tmp, adapters=ADAPTERS)
    work = bodies(args.requests)
    rows = []

    def gen(body):
        generate(
            GenerateRequest(
                model=str(pipe_dir),
                prompt=body["prompt"],
                output=str(tmp / "g.png"),
                negative=body["negative"],
                lora_dir=str(loras),
                steps=body["steps"],
                cfg=body["cfg"],
                seed=body["seed"],
                width=body["width"],
                height=body["height"],
            )
        )

    rows.append(summary("generate (sequential)", *timed(gen, work)))
    engine = Engine(str(pipe_dir), str(loras), max_adapters=ADAPTERS)
    engine_lat, engine_wall = timed(lambda b: engine.run([engine.parse(b)]), work)
    rows.append(summary("engine (sequential)", engine_lat, engine_wall))
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT / "src")}})
    try:
        for batch in (8, 1):
            options = ServeOptions(
                str(pipe_dir),
                str(loras),
                replicas=2,
                max_adapters_per_replica=ADAPTERS,
                max_batch=batch,
                batch_wait_s=0.05,
            )
            _, url = start(options, port=8799)
            timed(lambda b, u=url: post(u, b), work[:ADAPTERS], CLIENTS)  # warm-up: every adapter loaded
            lat, wall = timed(lambda b, u=url: post(u, b), work, CLIENTS)
            rows.append(summary(f"serve max_batch={batch}", lat, wall))
        lat, wall = timed(lambda b: post(url, b), work)
        rows.append(summary("serve one at a time", lat, wall))
        overhead = statistics.median(lat) - statistics.median(engine_lat)
        rate = [row["requests_per_s"] for row in rows]
        print(
            json.dumps(
                {
                    "ray_overhead_per_request_s": round(overhead, 4),
                    "batch8_vs_batch1_throughput": round(rate[2] / rate[3], 2),
                    "batch8_vs_generate_throughput": round(rate[2] / rate[0], 2),
                }
            )
        )
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
