"""The serve request parser alone (no Ray, no model): what a JSON body becomes, and each refusal's message."""

from __future__ import annotations

import pytest

from loraweave.errors import ServeRequestError
from loraweave.serve.engine import AdapterFolder, parse_request


@pytest.fixture
def store(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.safetensors").write_bytes(b"")
    return AdapterFolder(tmp_path)


def test_tags_then_listed_adapters_in_order(store):
    req = parse_request(
        {
            "prompt": "a cat <lora:a:0.5>, at night",
            "adapters": [{"name": "sub/b", "strength": 2}],
            "steps": 8,
            "cfg": 3,
            "seed": 7,
            "width": 64,
            "height": 128,
        },
        store,
    )
    assert req.prompt == "a cat, at night"
    assert req.adapters == [("a", 0.5), ("sub/b", 2.0)]
    assert (req.steps, req.cfg, req.seed, req.width, req.height) == (8, 3.0, 7, 64, 128)
    assert isinstance(req.cfg, float) and isinstance(req.steps, int)


def test_defaults(store):
    req = parse_request({"prompt": "x"}, store)
    assert (req.negative, req.adapters, req.steps, req.cfg, req.seed, req.width, req.height) == (
        "",
        [],
        20,
        7.0,
        42,
        512,
        512,
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "the request must be a JSON object with a string field 'prompt'"),
        ({"prompt": 1}, "the request must be a JSON object with a string field 'prompt'"),
        ({"prompt": "x", "steps": 1.5}, "field 'steps' must be an integer, got 1.5"),
        ({"prompt": "x", "cfg": True}, "field 'cfg' must be a number, got True"),
        ({"prompt": "x", "steps": 0}, "'steps' must be in 1..1000, got 0"),
        ({"prompt": "x", "cfg": -1}, "'cfg' must be finite and >= 0, got -1.0"),
        ({"prompt": "x", "seed": -1}, "'seed' must be in 0..2**63-1, got -1"),
        ({"prompt": "x", "width": 30}, "'width' and 'height' must be multiples of 8 in 8..4096, got 30x512"),
        ({"prompt": "x <lora:nope:1>"}, "no adapter 'nope'"),
        ({"prompt": "x <lora:../a:1>"}, "must stay inside"),
        (
            {"prompt": "x", "adapters": {}},
            "field 'adapters' must be a list of {'name': ..., 'strength': ...}",
        ),
        (
            {"prompt": "x", "adapters": [{"name": 1}]},
            "each of 'adapters' must be an object with a string 'name'",
        ),
        ({"prompt": "x", "adapters": [{"name": "zz"}]}, "no adapter 'zz'"),
        ({"prompt": "x", "adapters": [{"name": "a", "strength": "1"}]}, "field 'strength' must be a number"),
        (
            {"prompt": "x <lora:a:1:0.5>"},
            "adapter 'a': strength must be finite and the text-encoder strength",
        ),
        ({"prompt": "x", "adapters": [{"name": "a", "strength": float("inf")}]}, "strength must be finite"),
        ({"prompt": "x <lora:a:1>", "adapters": [{"name": "a"}]}, "an adapter is named twice in one request"),
    ],
)
def test_refusals_name_what_is_wrong(store, body, message):
    with pytest.raises(ServeRequestError) as caught:
        parse_request(body, store)
    assert message in str(caught.value)
