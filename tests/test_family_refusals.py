"""What each family's `load` refuses, and how: the miss kind and the whole message, one case per check.

The report shows these messages to users; a refactor of the checks must keep them and their order."""

from __future__ import annotations

import pytest
import torch

from loraweave.families import FAMILIES
from loraweave.families.base import PartRejected

T = torch.ones
NAN = torch.full((4, 2), float("nan"))


def _load(family: str, tensors: dict[str, torch.Tensor]):
    return FAMILIES[family].load_part(tensors, {r: f"k.{r}" for r in tensors}, None)


CASES = [
    # LoHa
    (
        "loha",
        {"hada_w1_a": T(4, 2)},
        "incomplete",
        "incomplete LoHa: no hada_w1_b, hada_w2_a, hada_w2_b tensor",
    ),
    (
        "loha",
        {
            "hada_w1_a": T(2, 4),
            "hada_w1_b": T(2, 3),
            "hada_w2_a": T(2, 4),
            "hada_w2_b": T(2, 3),
            "hada_t1": T(2, 2, 3, 3),
        },
        "incomplete",
        "incomplete LoHa: hada_t1 without its partner core",
    ),
    (
        "loha",
        {"hada_w1_a": NAN, "hada_w1_b": T(2, 3), "hada_w2_a": T(4, 2), "hada_w2_b": T(2, 3)},
        "non_finite",
        "bad tensor: k.hada_w1_a holds NaN or Inf",
    ),
    (
        "loha",
        {"hada_w1_a": T(4), "hada_w1_b": T(2, 3), "hada_w2_a": T(4, 2), "hada_w2_b": T(2, 3)},
        "shape_mismatch",
        "shape mismatch: LoHa factors hada_w1_a (4,), hada_w1_b (2, 3), hada_w2_a (4, 2), hada_w2_b (2, 3)",
    ),
    (
        "loha",
        {"hada_w1_a": T(4, 2), "hada_w1_b": T(2, 3), "hada_w2_a": T(4, 2), "hada_w2_b": T(2, 5)},
        "shape_mismatch",
        "shape mismatch: LoHa factors do not pair: hada_w1_a (4, 2), hada_w1_b (2, 3), hada_w2_a (4, 2), "
        "hada_w2_b (2, 5)",
    ),
    (
        "loha",
        {
            "hada_w1_a": T(2, 4),
            "hada_w1_b": T(2, 3),
            "hada_w2_a": T(2, 4),
            "hada_w2_b": T(2, 3),
            "hada_t1": T(2, 2, 3, 3),
            "hada_t2": T(2, 2, 1, 3),
        },
        "shape_mismatch",
        "shape mismatch: LoHa factors do not pair: hada_w1_a (2, 4), hada_w1_b (2, 3), hada_w2_a (2, 4), "
        "hada_w2_b (2, 3), hada_t1 (2, 2, 3, 3), hada_t2 (2, 2, 1, 3)",
    ),
    # DoRA
    (
        "dora",
        {"down": T(2, 3), "up": T(4, 2)},
        "incomplete",
        "incomplete DoRA: no dora_scale / lora_magnitude_vector tensor",
    ),
    ("dora", {"dora_scale": T(4, 1)}, "incomplete", "incomplete DoRA: magnitude with no factors"),
    (
        "dora",
        {"dora_scale": T(4, 1), "down": T(2, 3), "hada_w1_a": T(4, 2)},
        "incomplete",
        "incomplete DoRA: magnitude with loha + lora",
    ),
    (
        "dora",
        {"dora_scale": T(4, 1), "down": T(2, 3), "up": T(4, 2), "up_bias": T(4)},
        "unsupported",
        "unsupported family: DoRA with a LoRA bias (lora_B.bias); PEFT refuses it too",
    ),
    (
        "dora",
        {"dora_scale": T(4, 1), "oft_blocks": T(1, 2, 2)},
        "unsupported",
        "unsupported family: DoRA over oft_blocks (only LoRA, LoHa, LoKr)",
    ),
    (
        "dora",
        {"dora_scale": T(3, 1), "down": T(2, 3), "up": T(4, 2)},
        "shape_mismatch",
        "shape mismatch: k.dora_scale (3, 1) for 4 output rows",
    ),
    (
        "dora",
        {"dora_scale": T(2, 3, 2), "down": T(2, 3), "up": T(4, 2)},
        "shape_mismatch",
        "shape mismatch: k.dora_scale (2, 3, 2) for 4 output rows",
    ),
    # OFT
    ("oft", {"rescale": T(4, 1)}, "incomplete", "incomplete OFT: no oft_blocks or oft_diag"),
    (
        "oft",
        {"oft_blocks": T(2, 2, 2), "oft_diag": T(2, 2, 2)},
        "shape_mismatch",
        "shape mismatch: OFT part holds both oft_blocks and oft_diag",
    ),
    (
        "oft",
        {"oft_blocks": T(2, 2, 2), "zeta": T(1), "beta": T(1)},
        "unsupported",
        "unsupported family: OFT part with k.beta, k.zeta",
    ),
    (
        "oft",
        {"oft_blocks": T(2, 2, 3)},
        "shape_mismatch",
        "shape mismatch: k.oft_blocks (2, 2, 3) is not (blocks, b, b)",
    ),
    (
        "oft",
        {"oft_blocks": torch.full((2, 2, 2), float("inf"))},
        "non_finite",
        "bad tensor: k.oft_blocks holds NaN or Inf",
    ),
    # BOFT
    (
        "boft",
        {"oft_blocks": T(2, 2, 2, 2), "boft_s": T(4)},
        "unsupported",
        "unsupported family: BOFT part with k.boft_s",
    ),
    # boft_s without boft_R is a role the LyCORIS form has no use for: refused before completeness
    ("boft", {"boft_s": T(4)}, "unsupported", "unsupported family: BOFT part with k.boft_s"),
    ("boft", {"rescale": T(4)}, "incomplete", "incomplete BOFT: no oft_blocks or boft_R"),
    ("boft", {"boft_R": T(1, 2, 2, 2)}, "incomplete", "incomplete BOFT: PEFT boft_R without boft_s"),
    (
        "boft",
        {"oft_blocks": T(2, 3, 2, 2)},
        "shape_mismatch",
        "shape mismatch: k.oft_blocks (2, 3, 2, 2) is not a butterfly (m, n, b, b)",
    ),
    (
        "boft",
        {"oft_blocks": T(1, 2, 3, 3)},
        "shape_mismatch",
        "shape mismatch: k.oft_blocks (1, 2, 3, 3) is not a butterfly (m, n, b, b)",
    ),
    (
        "boft",
        {"oft_blocks": T(2, 2, 2, 3)},
        "shape_mismatch",
        "shape mismatch: k.oft_blocks (2, 2, 2, 3) is not a butterfly (m, n, b, b)",
    ),
    # IA3
    (
        "ia3",
        {"ia3_l": T(4, 1), "weight": T(4)},
        "bad_tensor",
        "bad part: PEFT ia3_l mixed with LyCORIS weight/on_input",
    ),
    (
        "ia3",
        {"ia3_l": T(4, 2)},
        "shape_mismatch",
        "shape mismatch: ia3_l (4, 2) is not (out, 1), (1, in) or (1, n, 1..)",
    ),
    ("ia3", {"weight": T(4)}, "incomplete", "incomplete IA3: no on_input tensor"),
    ("ia3", {"on_input": T(1)}, "incomplete", "incomplete IA3: no weight tensor"),
    (
        "ia3",
        {"weight": T(4), "on_input": T(2)},
        "bad_tensor",
        "bad tensor: k.on_input should be a scalar, has shape (2,)",
    ),
    (
        "ia3",
        {"weight": T(4, 2), "on_input": T(1)},
        "shape_mismatch",
        "shape mismatch: IA3 weight (4, 2) is not (n,) or (1, n, 1..)",
    ),
    # LoRA (Tucker core)
    (
        "lora",
        {"down": T(2, 3, 3, 3), "up": T(4, 2, 1, 1), "mid": T(2, 2, 3, 3)},
        "shape_mismatch",
        "shape mismatch: Tucker core (2, 2, 3, 3) with down (2, 3, 3, 3)",
    ),
    # PEFT OFT
    ("peft_oft", {"oft_R": T(2, 3), "x": T(1)}, "unsupported", "unsupported family: PEFT OFT part with k.x"),
]


@pytest.mark.parametrize(("family", "tensors", "kind", "message"), CASES)
def test_load_refuses_with_its_message(family, tensors, kind, message):
    with pytest.raises(PartRejected) as caught:
        _load(family, tensors)
    assert (caught.value.miss.kind, str(caught.value)) == (kind, message)


@pytest.mark.parametrize(
    ("family", "tensors", "check"),
    [
        ("ia3", {"ia3_l": T(1, 4)}, lambda f: f.on_input is True and f.peft),
        ("ia3", {"ia3_l": T(4, 1)}, lambda f: f.on_input is False),
        ("ia3", {"ia3_l": T(1, 4, 1, 1)}, lambda f: f.on_input is None),
        ("ia3", {"weight": T(1, 4, 1, 1), "on_input": T(1)}, lambda f: f.on_input is True and not f.peft),
        ("dora", {"dora_scale": T(1, 3), "down": T(2, 3), "up": T(4, 2)}, lambda f: f.on_out is False),
        ("dora", {"dora_scale": T(4, 1), "down": T(2, 3), "up": T(4, 2)}, lambda f: f.on_out is True),
        (
            "loha",
            {
                "hada_w1_a": T(2, 4),
                "hada_w1_b": T(2, 3),
                "hada_w2_a": T(2, 4),
                "hada_w2_b": T(2, 3),
                "hada_t1": T(2, 2, 3, 3),
                "hada_t2": T(2, 2, 3, 3),
            },
            lambda f: f.in_shape == (3, 3, 3) and f.rows == 4 and f.rank == 2,
        ),
        (
            "loha",
            {"hada_w1_a": T(4, 2), "hada_w1_b": T(2, 3, 3, 3), "hada_w2_a": T(4, 2), "hada_w2_b": T(2, 27)},
            lambda f: f.in_shape == (3, 3, 3),
        ),
        (
            "boft",
            {"oft_blocks": T(2, 2, 2, 2), "alpha": torch.tensor(0.5)},
            lambda f: f.constraint == 2.0 and f.rows == 4,
        ),
        ("boft", {"boft_R": T(1, 3, 3, 3), "boft_s": T(9, 1)}, lambda f: f.peft and f.rows == 9),
        (
            "oft",
            {"oft_blocks.1": T(1, 2, 2), "oft_blocks.0": T(2, 2, 2)},
            lambda f: [b.shape[0] for b, _ in f.segments] == [2, 1],
        ),
    ],
)
def test_load_accepts(family, tensors, check):
    assert check(_load(family, tensors))
