"""Row orders of our original-name tables, checked against diffusers' own single-file converters.

For a tiny diffusers model, build the original (fused) checkpoint from its weights using our alias tables
(each original tensor = the concatenation of the pieces' rows in source order), convert it back with the
converter diffusers ships for that architecture, and require every weight and bias to come back bit-exactly.
A wrong row order, a missing swap or a wrong target makes the round trip differ. The converters are an
independent statement of each checkpoint's layout; no LoRA math is involved here.
"""

from __future__ import annotations

import pytest
import torch
from helpers.registry import patch_tables
from helpers.tiny_configs import tiny_lumina2, tiny_sd3, tiny_wan, tiny_wan_vace
from helpers.tiny_models import tiny_zimage

from loraweave.arch.aliases import AliasTable


class _Lenient(dict):
    """Checkpoint stand-in: parameters our tables do not cover (norms, tables) come back as NaN filler."""

    def pop(self, key, *default):
        if key in self:
            return super().pop(key)
        return torch.full((12,), float("nan"))


def original_checkpoint(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    table = AliasTable(model)
    identity = set(table.modules)
    covered = {
        p.module
        for name, pieces in table.exact.items()
        if name not in identity and name not in table.fusion_names
        for p in pieces
    }
    ckpt: dict[str, torch.Tensor] = {}
    for name, pieces in table.exact.items():
        if name in identity and name in covered:
            continue  # reached through its original name
        if name.startswith("text_model.") or name in table.fusion_names:
            continue
        for suffix in ("weight", "bias"):
            parts = []
            for piece in pieces:
                t = getattr(table.modules[piece.module], suffix, None)
                if t is None:
                    break
                parts.append(t.detach()[piece.dst_start : piece.dst_start + piece.length])
            else:
                ckpt[f"{name}.{suffix}"] = torch.cat(parts)
    return ckpt


def patched_converter(name: str, **constants):
    """diffusers' converter `name` with its hard-coded widths (e.g. Lumina2's q_dim = 2304) set for a tiny
    model; nothing else of its code changes."""
    import inspect

    from diffusers.loaders import single_file_utils

    source = inspect.getsource(getattr(single_file_utils, name))
    for old, new in constants.items():
        assert old in source, old
        source = source.replace(old, new)
    namespace = dict(vars(single_file_utils))
    exec(source, namespace)  # noqa: S102 - the library's own function, constants replaced
    return namespace[name]


CASES = {
    "sd3": (tiny_sd3, "convert_sd3_transformer_checkpoint_to_diffusers"),
    "wan_t2v": (lambda: tiny_wan(False), "convert_wan_transformer_to_diffusers"),
    "wan_i2v": (lambda: tiny_wan(True), "convert_wan_transformer_to_diffusers"),
    "wan_vace": (tiny_wan_vace, "convert_wan_transformer_to_diffusers"),
    # q/k/v widths hard-coded (2304/768/768); its prefix stripping re-keys the dict but then pops the old
    # keys, so it gets unprefixed names.
    "lumina2": (
        tiny_lumina2,
        lambda: patched_converter(
            "convert_lumina2_to_diffusers",
            **{"q_dim = 2304": "q_dim = 64", "k_dim = v_dim = 768": "k_dim = v_dim = 32"},
        ),
        "",
    ),
    "zimage": (tiny_zimage, "convert_z_image_transformer_checkpoint_to_diffusers"),
}


@pytest.mark.parametrize("arch", sorted(CASES))
def test_tables_round_trip_through_the_diffusers_converter(arch):
    from diffusers.loaders import single_file_utils

    build, converter, *prefix = CASES[arch]
    prefix = prefix[0] if prefix else "model.diffusion_model."
    model = build()
    ckpt = original_checkpoint(model)
    assert ckpt, "no original names for this architecture"
    convert = getattr(single_file_utils, converter) if isinstance(converter, str) else converter()
    converted = convert(_Lenient({f"{prefix}{k}": v for k, v in ckpt.items()}))
    state = model.state_dict()
    checked = 0
    for key, value in converted.items():
        if key in state and not torch.isnan(value).any():
            assert torch.equal(value, state[key]), key
            checked += 1
    # Every module of the model came back from the original checkpoint, fused ones included.
    produced = {k.rsplit(".", 1)[0] for k in converted if k in state}
    missing = {m for m in AliasTable(model).modules if m not in produced}
    assert not missing, sorted(missing)[:10]
    assert checked >= len(ckpt)


@pytest.mark.parametrize(
    "arch, table_name, source, fn",
    [
        ("lumina2", "lumina2", "layers.{i}.attention.qkv", lambda t: (t[0], t[2], t[1])),
        ("wan_vace", "wan", "vace_blocks.{i}.before_proj", lambda t: (t[0].replace("proj_in", "proj_out"),)),
    ],
)
def test_round_trip_catches_a_swapped_row(arch, table_name, source, fn, monkeypatch):
    import dataclasses

    def mutate(table):
        return dataclasses.replace(
            table,
            aliases=tuple(
                dataclasses.replace(a, targets=fn(a.targets)) if a.source == source else a
                for a in table.aliases
            ),
        )

    # only the architecture's own table: another one may name the same source (Nunchaku Z-Image's fused qkv)
    patch_tables(monkeypatch, lambda t: mutate(t) if t.name == table_name else t)
    with pytest.raises(AssertionError):
        test_tables_round_trip_through_the_diffusers_converter(arch)
