"""Shared fixtures: the path to ../shared real data, and LyCORIS class state restored after each test.

Plain helper functions live in helpers/common.py; tiny real-architecture models in helpers/tiny_models.py;
what test modules share lives in helpers/ too (a test module never imports another, test_test_layout.py)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Shared builders and checks live in helpers/: their asserts get the same introspection as a test module's.
pytest.register_assert_rewrite("helpers")

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")
# inspect caches architecture skeletons; tests keep theirs out of the user's ~/.cache.
if "LORAWEAVE_CACHE" not in os.environ:  # made here (subprocesses inherit it), removed when the session ends
    os.environ["LORAWEAVE_CACHE"] = tempfile.mkdtemp(prefix="loraweave-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LORAWEAVE_CACHE"], True)

SHARED = Path(__file__).resolve().parents[2] / "shared"
REALDATA = SHARED / "realdata"


@pytest.fixture(scope="session")
def realdata() -> Path:
    # Real material must be present: a missing ../shared is a failure, never a skip.
    assert REALDATA.is_dir(), f"missing real test data at {REALDATA}"
    return REALDATA


# create_lycoris writes presets into these LycorisNetwork class attributes.
LYCORIS_CLASS_ATTRS = (
    "ENABLE_CONV",
    "TARGET_REPLACE_MODULE",
    "TARGET_REPLACE_NAME",
    "MODULE_ALGO_MAP",
    "NAME_ALGO_MAP",
    "LORA_PREFIX",
    "USE_FNMATCH",
    "TARGET_EXCLUDE_NAME",
)


@pytest.fixture
def lycoris_class_attrs(monkeypatch):
    """create_lycoris writes presets into LycorisNetwork's class attributes: restore them after each test."""
    # Imported here, not at the top: only the LyCORIS tests need the package.
    from lycoris.wrapper import LycorisNetwork

    for attr in LYCORIS_CLASS_ATTRS:
        monkeypatch.setattr(LycorisNetwork, attr, getattr(LycorisNetwork, attr))
    return LycorisNetwork


@pytest.fixture
def lycoris_state(lycoris_class_attrs):
    """lycoris_class_attrs, and the test starts from an empty MODULE_ALGO_MAP."""
    lycoris_class_attrs.MODULE_ALGO_MAP = {}


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): on 2 shared
    cores tiny models run ~10x faster, small LAPACK calls stop stalling, and float summation order matches a
    1-thread replica."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Markers by module (pyproject registers them; `-m "not slow and not realdata"` picks a quick subset).
MODULE_MARKERS: dict[str, tuple[str, ...]] = {
    "test_arch_anima_sana": ("realdata",),
    "test_arch_dits2": ("realdata",),
    "test_arch_unet_original": ("realdata",),
    "test_block_weights": ("realdata",),
    "test_cli_convert": ("realdata",),
    "test_cli_extract": ("realdata",),
    "test_cli_inspect": ("realdata",),
    "test_comfy_arch_names": ("comfy",),
    "test_comfy_key_differential": ("comfy",),
    "test_comfy_arch_video": ("comfy",),
    "test_comfy_arch_weights": ("comfy",),
    "test_comfy_browser": ("comfy", "slow"),  # ComfyUI's server and headless Chromium
    "test_comfy_browser_multi": ("comfy", "slow"),
    "test_comfy_browser_picker": ("comfy", "slow"),
    "test_comfy_control_lora": ("comfy",),
    "test_comfy_control_other_inputs": ("comfy",),
    "test_comfy_errors": ("comfy",),
    "test_comfy_gguf": ("comfy",),
    "test_comfy_harness": ("comfy",),
    "test_comfy_model_input": ("comfy",),
    "test_comfy_model_only": ("comfy", "realdata"),
    "test_comfy_node_features": ("comfy",),
    "test_comfy_nodes": ("comfy",),
    "test_comfy_pack_entry": ("comfy",),
    "test_comfy_realdata": ("comfy", "realdata"),
    "test_comfy_runtime": ("comfy",),
    "test_comfy_sampling": ("comfy",),
    "test_comfy_stack": ("comfy",),
    "test_comfy_swap": ("comfy",),
    "test_comfy_toy_arch": ("comfy",),
    "test_comfy_weights": ("comfy",),
    "test_comfy_wrong_arch": ("comfy", "realdata"),
    "test_compile": ("slow",),  # inductor codegen: about a minute per whole model
    "test_detect": ("realdata",),
    "test_diffusers_dropin": ("realdata",),
    "test_family_lokr": ("realdata",),
    "test_fuzz": ("realdata",),
    "test_inspect_pictures": ("realdata",),
    "test_io_safetensors": ("realdata",),
    "test_nunchaku_arch": ("realdata",),
    "test_nunchaku_backend_realsize": ("realsize",),  # one Flux-width SVDQW4A4Linear
    "test_nunchaku_seed_loader": ("comfy", "slow"),  # the seed is a ComfyUI node pack
    "test_realdata": ("realdata",),
    "test_realsize_acceptance": ("realsize", "realdata"),
    "test_realsize_catalog": ("realsize",),
    "test_realsize_comfy": ("realsize", "comfy", "realdata"),  # ComfyUI's full-size Flux on meta
    "test_realsize_comfy_gguf": ("realsize", "comfy"),  # one full-width Q4_K Flux layer through the pack
    "test_realsize_comfy_mechanisms": ("realsize", "comfy"),  # runtime borrowing, Flux Fill, full width
    "test_realsize_comfy_positional": ("realsize", "comfy", "realdata"),  # ComfyUI's full-size SD1.5 on meta
    "test_realsize_mechanisms": ("realsize",),
    "test_realsize_quant": ("realsize",),
    "test_realsize_sd15": ("realdata", "realsize"),  # a full-size SD1.5 UNet in fp16
    "test_robustness": ("realdata",),
    "test_serve": ("slow",),  # a local Ray cluster
    "test_serve_cli": ("slow",),
    "test_size_arithmetic": ("realsize",),
    "test_streaming_cuda": ("cuda",),
    "test_undo_cuda": ("cuda",),
    "test_user_round2_bake": ("realdata",),
    "test_user_round2_convert": ("realdata", "comfy"),  # ComfyUI's key map, in a subprocess
    "test_user_round2_inspect": ("realdata",),
    "test_user_surface": ("realdata",),
    "test_wrong_arch": ("realdata",),
}


# Modules that run case by case (helpers.comfy_arch_cases.built_case keeps one tiny ComfyUI model at a time):
# their tests are reordered by the `name` parameter, stably.
BY_CASE = ("test_comfy_arch_names", "test_comfy_arch_weights")


def _by_case(items) -> None:
    for module in BY_CASE:
        places = [i for i, item in enumerate(items) if item.module.__name__.rpartition(".")[2] == module]
        ordered = sorted(
            (items[i] for i in places),
            key=lambda item: str(getattr(item, "callspec", None) and item.callspec.params.get("name", "")),
        )
        for i, item in zip(places, ordered, strict=True):
            items[i] = item


def _markers(module: str) -> tuple[str, ...]:
    """MODULE_MARKERS' markers, and `comfy` for every module named for the pack (test_comfy_*,
    test_realsize_comfy_*): scripts/test.sh runs those again on the newest ComfyUI tree, none forgotten."""
    named = ("comfy",) if "comfy" in module.split("_") else ()
    return tuple(dict.fromkeys(MODULE_MARKERS.get(module, ()) + named))


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--module-share",
        default=None,
        metavar="K/N",
        help="run only the K-th of N shares of the selected test modules (helpers/module_share.py)",
    )


def pytest_configure(config) -> None:
    config.pluginmanager.register(ModuleShare(), "loraweave-module-share")


class ModuleShare:
    """--module-share: its hook runs after -m and -k have deselected (and after the markers above were added),
    so the shares split what is left."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items) -> None:
        value = config.getoption("--module-share")
        if value is None:
            return
        from helpers.module_share import share_of

        try:
            keep = share_of([_module(item) for item in items], value)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from exc
        config.hook.pytest_deselected(items=[item for item in items if _module(item) not in keep])
        items[:] = [item for item in items if _module(item) in keep]


def _module(item) -> str:
    return item.module.__name__.rpartition(".")[2]


def pytest_collection_modifyitems(items) -> None:
    _by_case(items)
    for item in items:
        for name in _markers(item.module.__name__.rpartition(".")[2]):
            item.add_marker(name)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "cuda" in callspec.id.split("-"):
            item.add_marker("cuda")  # device-parametrized cases (test_offload's "cuda")
