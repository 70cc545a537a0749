"""The LoRA picker's architecture marks (issue 43, "beyond the defects"): for each file of ComfyUI's loras
folders, the architecture its header names and whether it fits the model a loader ran on, read from the
header alone (no tensor byte read), the same decision the loaders' refusal makes (engine/decide.py). On the
real files: the SD2 file and the Flux file do not fit an SD1.5 model, the SD1 files do; files detection is
unsure of (the early LoKr, cloneofsimo, a truncated file) are never marked. The route serves the same
mapping, and each loader's run names its model's architecture beside its report."""

from __future__ import annotations

import asyncio
import mmap

import pytest
from conftest import REALDATA
from helpers.comfy_env import import_comfy
from helpers.comfy_full import SD15_UNET, meta_patcher
from helpers.comfy_home import comfy_home_fixture, run_prompt  # noqa: F401  (fixture)
from helpers.comfy_sampling import REGISTRY, register_test_nodes

SD2_FILE = "JustinJiangNext__lora-2.0__pytorch_lora_weights.safetensors"
FLUX_FILE = "leighwoods__public-loras__lora.safetensors"
SD1_FILES = (
    "catundchat__stable-diffusion-v1.5-lora__pytorch_lora_weights.safetensors",
    "Haseebae__Synthetic_dataset_generator_with_stable_diffusion__pytorch_lora_weights.safetensors",
    "timohavdk__sd-lora__2100-lora.safetensors",
)
UNSURE = (  # detection names no one model: never marked
    "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors",
    "cloneofsimo__lora__analog_svd_rank4.safetensors",
)
TRUNCATED = "broken/Srikanth1408__Stable_Diffusion-Hackathon__pytorch_lora_weights__TRUNCATED.safetensors"


@pytest.fixture
def loras(comfy_home, realdata):
    """The real files in a loras folder of ComfyUI's."""
    import folder_paths

    folder = str(realdata / "lora")
    folder_paths.add_model_folder_path("loras", folder)
    yield folder
    folder_paths.folder_names_and_paths["loras"][0].remove(folder)


class _Counted:
    """A file opened by the header reader, counting the bytes it hands out."""

    def __init__(self, f, reads: dict, path: str) -> None:
        self.f, self.reads, self.path = f, reads, path

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()

    def fileno(self) -> int:
        return self.f.fileno()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.reads[self.path] = self.reads.get(self.path, 0) + len(data)
        return data


@pytest.fixture
def header_reads(monkeypatch):
    """{path: bytes read} of every file the header reader opens; mapping a file or asking loraweave's
    reader or safetensors' for a tensor raises."""
    import safetensors
    import safetensors.torch

    from loraweave.comfy import picker
    from loraweave.io import safetensors_file
    from loraweave.io.file_cache import FileCache

    def refuse(*args, **kwargs):
        raise AssertionError("tensor data read")

    for owner, name in (
        (safetensors_file.SafetensorsFile, "__init__"),
        (safetensors_file.SafetensorsFile, "get"),
        (safetensors_file.SafetensorsFile, "scalar"),
        (safetensors_file.mmap, "mmap"),
        (safetensors, "safe_open"),
        (safetensors.torch, "load_file"),
    ):
        monkeypatch.setattr(owner, name, refuse)
    kept_none: FileCache = FileCache(picker.FILES_KEPT, weigh_files=False)  # nothing kept yet
    monkeypatch.setattr(picker, "header_archs", kept_none)
    reads: dict[str, int] = {}
    monkeypatch.setattr(
        safetensors_file,
        "open",
        lambda path, mode: _Counted(open(path, mode), reads, str(path)),
        raising=False,
    )
    assert mmap.mmap is refuse
    return reads


def _header_size(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_lora_archs_marks_other_architectures_from_headers_only(loras, header_reads):
    from loraweave.comfy.picker import lora_archs

    found = lora_archs("sd1")
    files = found["files"]
    assert found["model"] == {"name": "sd1", "label": "SD1.5"}
    assert files[SD2_FILE] == {"arch": "sd2", "label": "SD2", "fits": False}
    assert files[FLUX_FILE] == {"arch": "flux", "label": "Flux", "fits": False}
    for name in SD1_FILES:
        assert files[name] == {"arch": "sd1", "label": "SD1.5", "fits": True}, name
    for name in (*UNSURE, TRUNCATED):
        assert files[name] == {"arch": None, "label": None, "fits": None}, name
    # each file opened was read up to the end of its header, never further (its tensors: not a byte)
    assert {p.rsplit("/", 1)[-1] for p in header_reads} >= {SD2_FILE, FLUX_FILE, *SD1_FILES}
    for path, read in header_reads.items():
        assert read <= _header_size(path), path  # a broken file's: its length field only
        if path.rsplit("/", 1)[-1] in (SD2_FILE, FLUX_FILE, *SD1_FILES):
            assert read == _header_size(path), path

    on_flux = lora_archs("flux")["files"]
    assert on_flux[FLUX_FILE]["fits"] is True and on_flux[SD2_FILE]["fits"] is False
    assert all(on_flux[name]["fits"] is False for name in SD1_FILES)
    header_reads.clear()
    assert lora_archs("sd2")["files"][SD2_FILE]["fits"] is True
    assert header_reads == {}  # kept by file identity: nothing read again
    unknown = lora_archs(None)
    assert unknown["model"] is None and unknown["files"][SD2_FILE] == {
        "arch": "sd2",
        "label": "SD2",
        "fits": None,
    }
    assert lora_archs("no-such-model")["model"] is None


def test_marks_are_the_refusals_decision(loras):
    """The files marked on a model are the files the loaders' refusal names on it (the whole file read)."""
    from loraweave.arch.fit import model_arch
    from loraweave.comfy.picker import lora_archs
    from loraweave.engine.decide import arch_check
    from loraweave.formats.adapter import load_adapter

    names = [SD2_FILE, FLUX_FILE, *SD1_FILES, *UNSURE]
    for model in ("sd1", "sd2", "flux", "sdxl"):
        files = lora_archs(model)["files"]
        marked = {n for n in names if files[n]["fits"] is False}
        adapters = [load_adapter(REALDATA / "lora" / n) for n in names]
        refused = {o.adapter for o in arch_check(adapters, model_arch(model), False).suspects}
        assert marked == refused, model


def test_route_serves_the_mapping(loras):
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from loraweave.comfy.picker import ROUTE, add_routes, lora_archs

    routes = web.RouteTableDef()
    add_routes(routes)
    app = web.Application()
    app.add_routes(routes)

    async def ask(*queries: str) -> list[dict]:
        async with TestClient(TestServer(app)) as client:
            responses = [await client.get(ROUTE + q) for q in queries]
            assert [r.status for r in responses] == [200] * len(queries)
            return [await r.json() for r in responses]

    on_sd1, on_none = asyncio.run(ask("?model=sd1", ""))
    assert on_sd1 == lora_archs("sd1") and on_sd1["files"][SD2_FILE]["fits"] is False
    assert on_none["model"] is None


def test_loader_run_names_its_models_architecture(loras, monkeypatch):
    """The run's ui output carries the model's architecture beside the report (what the web script asks
    the route with)."""
    c = import_comfy()
    register_test_nodes(monkeypatch)
    monkeypatch.setitem(REGISTRY, "sd15", meta_patcher(c.supported_models.SD15, SD15_UNET))
    prompt = {
        "1": {"class_type": "LWTestModelSource", "inputs": {"name": "sd15"}},
        "2": {
            "class_type": "LoraWeaveLoaderModelOnly",
            "inputs": {
                "model": ["1", 0],
                "lora_name": SD1_FILES[0],
                "strength_model": 1.0,
                "mode": "merge",
                "strict": False,
            },
        },
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 1]}},
    }
    valid, errors, ex, _ = run_prompt(prompt)
    assert valid, errors
    ui = ex.history_result["outputs"]["2"]
    assert ui["loraweave_model"] == ["sd1"] or ui["loraweave_model"] == ("sd1",)
    assert "keys_applied=" in ui["text"][0]
