"""A tiny real SD1.5 pipeline saved to a folder (seeded weights, tokenizer files written offline, nothing
downloaded) and a seeded sample LoRA for it: what `loraweave demo --generate` runs, and what the tests
generate with."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..io.write import atomic_path, honour_umask_under, save_file


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves, the rest to
    256+."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_clip_tokenizer(folder: Path) -> None:
    """A byte-level CLIP BPE tokenizer with no merges: every byte is a token (vocab 514), max length 77."""
    folder.mkdir(parents=True, exist_ok=True)
    chars = _byte_chars()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab |= {c + "</w>": len(chars) + i for i, c in enumerate(chars)}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    config = {
        "model_max_length": 77,
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "CLIPTokenizer",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def tiny_sd15(folder: Path, seed: int = 0) -> Path:
    """StableDiffusionPipeline with a 2-level UNet (cross-attention 32), 2-level VAE and a 2-layer CLIP: 64x64
    images in ~0.05 s per step on one CPU core. Saved with save_pretrained (atomically, modes under the umask:
    an existing folder keeps its other files); loads offline. The folder's parent must exist."""
    with atomic_path(folder, folder=True) as tmp:
        _save_tiny_sd15(tmp, seed)
        honour_umask_under(tmp)
    return folder


def _save_tiny_sd15(folder: Path, seed: int) -> None:
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    write_clip_tokenizer(folder / "tokenizer")
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
        norm_num_groups=8,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=8,
        sample_size=16,
    )
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=520,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            projection_dim=32,
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
        )
    )
    tokenizer = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1
    )
    pipe = StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    # a type checker reads diffusers' __init__ through its placeholder classes (no save_pretrained)
    pipe.save_pretrained(folder)  # type: ignore[attr-defined]


def sample_lora(pipe, path: Path, seed: int = 3, text_encoder: bool = True) -> Path:
    """A kohya LoRA (rank 4, alpha 2) on the UNet's attention Linears and, with `text_encoder`, the TE's q/v
    projections of `pipe` (a loaded StableDiffusionPipeline)."""
    g = torch.Generator().manual_seed(seed)
    targets = [
        ("lora_unet_", n, m)
        for n, m in pipe.unet.named_modules()
        if isinstance(m, torch.nn.Linear) and "attentions" in n
    ]
    if text_encoder:
        targets += [
            ("lora_te_", n, m)
            for n, m in pipe.text_encoder.named_modules()
            if n.endswith(("q_proj", "v_proj"))
        ]
    tensors = {}
    for prefix, name, module in targets:
        stem = prefix + name.replace(".", "_")
        tensors[f"{stem}.lora_down.weight"] = torch.randn(4, module.in_features, generator=g) * 0.3
        tensors[f"{stem}.lora_up.weight"] = torch.randn(module.out_features, 4, generator=g) * 0.3
        tensors[f"{stem}.alpha"] = torch.tensor(2.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path, metadata={"ss_network_module": "networks.lora"})  # atomic, mode under the umask
    return path
