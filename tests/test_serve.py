"""`loraweave.serve` on local Ray (CPU): 2 renderer replicas of a tiny SD1.5 pipeline, 5 adapters + a te-less
one and a wrong-architecture file in the store. Every request loop is bounded by a count and an HTTP timeout.

Images are compared bit for bit (np.array_equal) with `loraweave generate --lora-apply-mode runtime`: a
replica renders with runtime adapters, each sample's terms in its own tag order. The default `auto` merges
into the weights, a different float sum: (W + ΔW)·x vs W·x + B·(A·x), at most one 8-bit level on a few
values."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from helpers.serve_fixtures import SETTINGS, build, generated, pixels, rendered

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'loraweave[serve]')")

SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = Path(__file__).resolve().parent
REQUESTS = int(os.environ.get("LORAWEAVE_SERVE_REQUESTS", "20"))
TIMEOUT_S = 120


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    pipe_dir, loras = build(root)
    return pipe_dir, loras, root


@pytest.fixture(scope="module")
def server(files):
    from ray import serve

    from loraweave.serve import start
    from loraweave.serve.app import ServeOptions

    pipe_dir, loras, root = files
    path = os.pathsep.join((str(SRC), str(TESTS)))  # replicas import serve_fixtures' FaultyEngine
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    options = ServeOptions(
        str(pipe_dir),
        str(loras),
        replicas=2,
        max_adapters_per_replica=4,
        max_batch=8,
        batch_wait_s=0.3,
        engine="helpers.serve_fixtures:FaultyEngine",
    )
    try:
        _, url = start(options, port=8765)
        yield url, pipe_dir, loras, root
    finally:
        serve.shutdown()
        ray.shutdown()


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + "/", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _image(result: dict) -> np.ndarray:
    return pixels(base64.b64decode(result["png_b64"]))


def _mixed(i: int) -> dict:
    """Request i: no adapter, one, two (one of them text-encoder-less), by tag or by the explicit list."""
    kinds = [
        f"a cat <lora:a{i % 5}:0.8>",
        f"a dog <lora:a{(i + 1) % 5}:1> <lora:u:0.5>",
        "a house",
        f"a tree <lora:a{(i + 2) % 5}:0.4>",
    ]
    body = {**SETTINGS, "prompt": kinds[i % 4], "seed": 100 + i}
    if i % 8 == 7:  # the explicit list instead of a tag
        body |= {"prompt": "a tree", "adapters": [{"name": f"a{(i + 2) % 5}", "strength": 0.4}]}
    return body


def _as_tags(body: dict) -> str:
    return body["prompt"] + "".join(f" <lora:{a['name']}:{a['strength']}>" for a in body.get("adapters", []))


def assert_generate_bound(got: np.ndarray, expected: np.ndarray, what) -> None:
    """A served image from a batch of n > 1 vs generate's batch of 1: the base pipeline alone rounds by batch
    size (measured, no adapter: |Δ| <= 1.3e-6 in [0, 1], at most one 8-bit level on a value or two of
    3072)."""
    diff = np.abs(got - expected)
    assert diff.max() <= 1 and (diff > 0).sum() <= 8, (what, diff.max(), (diff > 0).sum())


def test_one_at_a_time_equals_generate(server):
    url, pipe_dir, loras, root = server
    for i in range(REQUESTS):
        body = _mixed(i)
        code, result = post(url, body)
        assert code == 200, result
        expected = generated(
            pipe_dir, loras, _as_tags(body), body["seed"], root / f"g{i}.png", mode="runtime"
        )
        assert result["metrics"]["batch_size"] == 1
        assert np.array_equal(_image(result), expected), (i, body, np.abs(_image(result) - expected).max())
        names = _names(body, loras)
        if i < 2:  # negative control: one strength 0.05 off gives another image
            other = body["prompt"].split(" <")[0] + "".join(
                f" <lora:{n}:{s + 0.05 * (j == 0)}>" for j, (n, s) in enumerate(names)
            )
            near = generated(pipe_dir, loras, other, body["seed"], root / "near.png", mode="runtime")
            assert not np.array_equal(_image(result), near)
        metrics = result["metrics"]
        assert (
            set(metrics) >= {"queue_s", "batch_size", "adapter_load", "replica"} and metrics["queue_s"] >= 0
        )
        assert sorted(result["report"]) == sorted({n for n, _ in names})


def _names(body: dict, loras: Path):
    from loraweave.request.prompt import parse_prompt

    _, specs = parse_prompt(_as_tags(body), loras)
    return [
        (Path(s.source).relative_to(loras.resolve()).with_suffix("").as_posix(), s.strength) for s in specs
    ]


def test_same_adapters_hit_after_the_first(server):
    url = server[0]
    body = {**SETTINGS, "prompt": "a boat <lora:a3:0.6> <lora:a4:0.9>"}
    loads = [post(url, body | {"seed": s})[1]["metrics"]["adapter_load"] for s in range(4)]
    assert loads == ["miss", "hit", "hit", "hit"]


def test_mixed_batch_is_formed_and_exact(server):
    """Concurrent requests with different adapter sets meet in one pipeline call (Handle.batch) at least once;
    every image is bit-equal to generate's arithmetic at that batch size, and within the base pipeline's own
    batch-size rounding of generate's image."""
    url, pipe_dir, loras, root = server
    names = ["a0", "a1", "a2", "a3", "a4", "u"]  # six sets on two replicas: one holds three at least
    bodies = [
        {**SETTINGS, "prompt": f"a bird <lora:{n}:{0.5 + i / 10}>", "seed": 200 + i}
        for i, n in enumerate(names)
    ]
    seen = 0
    for _ in range(3):  # bounded: batching depends on arrival times
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: post(url, b), bodies))
        assert all(code == 200 for code, _ in answers), answers
        mixed = [(b, r) for b, (_, r) in zip(bodies, answers, strict=True) if r["metrics"]["batch_sets"] >= 3]
        for body, result in mixed:
            got, size = _image(result), result["metrics"]["batch_size"]
            assert np.array_equal(got, rendered(pipe_dir, loras, body["prompt"], body["seed"], size)), (
                body,
                size,
            )
            expected = generated(
                pipe_dir, loras, body["prompt"], body["seed"], root / "batch.png", mode="runtime"
            )
            assert_generate_bound(got, expected, body)
        seen += len(mixed)
        if seen:
            break
    assert seen, "no batch held three different adapter sets in 3 rounds"


def test_engine_mixed_batch_is_row_independent(files, monkeypatch):
    """Without Ray: a batch of three different adapter sets (two adapters not in resident order; a conv-only
    LoCon). Each sample is bit-equal, as floats and as PNG, to generate's arithmetic at batch size 3, whatever
    its companions; a lone request equals generate itself. Negative controls (floats): another strength, the
    sum in resident order, and Handle.batch's non-exact forms (gated whole pair; per-run GEMMs): each ~1e-6
    off."""
    from loraweave.mechanisms.sampling import mix, persample
    from loraweave.serve import Engine

    pipe_dir, loras, root = files
    engine = Engine(str(pipe_dir), str(loras), max_adapters=5)
    engine.store.ensure(["styles/u", "a3", "a1"])  # resident order u, a3, a1: not request 0's tag order
    prompts = [
        "a dog <lora:a1:1> <lora:u:0.5>",
        "a cat <lora:a3:0.3> <lora:c:0.6>",
        "a house <lora:a0:0.8>",
        "a tree",
    ]
    reqs = [engine.parse({**SETTINGS, "prompt": p, "seed": 300 + i}) for i, p in enumerate(prompts)]
    run = lambda batch: [pixels(base64.b64decode(r["png_b64"])) for r in engine.run(batch)]  # noqa: E731
    floats = engine._render(reqs[:3], output_type="np")
    for i in range(3):
        assert np.array_equal(
            floats[i], rendered(pipe_dir, loras, prompts[i], 300 + i, copies=3, floats=True)
        ), i
    got = run(reqs[:3])
    for i in range(3):
        assert np.array_equal(got[i], rendered(pipe_dir, loras, prompts[i], 300 + i, copies=3)), i
    assert np.array_equal(
        run([reqs[0], reqs[3], reqs[1]])[2], got[1]
    )  # other companions, place: the same image
    lone = run([reqs[1]])[0]
    assert np.array_equal(
        lone, generated(pipe_dir, loras, prompts[1], 301, root / "lone.png", mode="runtime")
    )
    near = engine.parse({**SETTINGS, "prompt": "a dog <lora:a1:1.05> <lora:u:0.5>", "seed": 300})
    assert not np.array_equal(run([near, reqs[1], reqs[2]])[0], got[0])
    engine.exact = False
    assert not np.array_equal(engine._render(reqs[:3], output_type="np")[1], floats[1])  # gated
    monkeypatch.setattr(mix, "GATED_MAX_TOKEN_RANKS", 0)
    assert not np.array_equal(
        engine._render(reqs[:3], output_type="np")[1], floats[1]
    )  # per-run GEMMs (the conv)
    engine.exact = True
    ordered = (
        persample._one_sample
    )  # u first, as resident: request 0 summed in the store's order, not its tags'
    monkeypatch.setattr(
        persample, "_one_sample", lambda *a: tuple(sorted(ordered(*a), key=lambda kv: kv[0] != "styles/u"))
    )
    assert not np.array_equal(engine._render(reqs[:3], output_type="np")[0], floats[0])


@pytest.mark.parametrize(
    ("prompt", "code", "message"),
    [
        ("x <lora:nope:1>", 400, "no adapter 'nope'"),
        ("x <lora:../a0:1>", 400, "must stay inside"),
        ("x <lora:bad/sdxl:1>", 422, "does not fit this model: 0/2 keys land"),
    ],
)
def test_bad_requests_are_4xx_and_the_server_keeps_serving(server, prompt, code, message):
    url = server[0]
    status, result = post(url, {**SETTINGS, "prompt": prompt})
    assert (status, message in result["error"]) == (code, True), result
    assert post(url, {**SETTINGS, "prompt": "after <lora:a0:1>"})[0] == 200


def test_bad_fields_and_health(server):
    url = server[0]
    assert post(url, {"prompt": "x", "steps": 0})[0] == 400
    assert post(url, {"prompt": "x", "width": 30})[0] == 400
    assert post(url, {"nope": 1})[0] == 400
    with urllib.request.urlopen(url + "/health", timeout=TIMEOUT_S) as answer:
        health = json.loads(answer.read())
    assert health["status"] == "ok" and health["replica"]["capacity"] == 4


def test_replica_dying_mid_render_gives_the_image_or_an_error(server):
    """A replica killed inside the UNet's forward (os._exit, as an OOM kill: no answer). Once: the ingress
    renders the request again on another replica, the right image. Twice in a row: a clear HTTP 503 and no
    image. Then the server keeps serving (Ray Serve restarts the replicas). Bounded by count and time."""
    url, pipe_dir, loras, root = server
    arm = root / "crash.arm"  # FaultyEngine: deaths left for prompts with CRASH
    body = {**SETTINGS, "prompt": "a CRASH cat <lora:a0:0.7>", "seed": 400}
    expected = generated(pipe_dir, loras, body["prompt"], 400, root / "crash.png", mode="runtime")
    arm.write_text("1")
    code, result = post(url, body)
    assert not arm.exists(), "the replica did not die"
    assert code == 200, result
    assert np.array_equal(_image(result), expected)
    arm.write_text("2")
    code, result = post(url, body)
    assert not arm.exists(), "two replicas did not die"
    assert (code, "png_b64" in result) == (503, False), (code, result.get("error"))
    assert "died while rendering" in result["error"]
    started, after = time.monotonic(), {**body, "prompt": "a cat <lora:a0:0.7>", "seed": 401}
    for _ in range(30):  # Ray restarts the dead replicas: poll until one answers
        code, result = post(url, after)
        if code == 200 or time.monotonic() - started > 240:
            break
        time.sleep(2)
    assert code == 200, result
    assert np.array_equal(
        _image(result), generated(pipe_dir, loras, after["prompt"], 401, root / "after.png", mode="runtime")
    )


def test_nothing_outside_serve_imports_ray():
    code = (
        "import sys, loraweave, loraweave.cli, loraweave.serve, loraweave.tools.generate; "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        check=True,
    )
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "loraweave.serve.engine",
        "no_such_module:Engine",
        "os:path",
        "loraweave.serve.engine:NoSuchClass",
        "loraweave.serve.engine:ServeRequest",
    ],
)
def test_engine_option_names_an_engine_class_or_is_refused(bad):
    """ServeOptions.engine (the replicas' "module:Class"): anything but an Engine subclass is a typed error
    naming the option and the value, before a replica builds anything."""
    from loraweave.errors import ServeRequestError
    from loraweave.serve.app import engine_class
    from loraweave.serve.engine import Engine

    assert engine_class("loraweave.serve.engine:Engine") is Engine
    with pytest.raises(ServeRequestError, match=r"engine .*expected 'module:Class'"):
        engine_class(bad)
