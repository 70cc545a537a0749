"""What `loraweave inspect` reports for each real file, shared with the picture tests."""

from __future__ import annotations

# file -> (layout, architecture), from realdata/lora/README.md (what each file is).
EXPECTED = {
    "Haseebae__Synthetic_dataset_generator_with_stable_diffusion__pytorch_lora_weights.safetensors": (
        "diffusers_attn_processor",
        "sd1",
    ),
    "JustinJiangNext__lora-2.0__pytorch_lora_weights.safetensors": ("diffusers_lora_layer", "sd2"),
    "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors": ("kohya", "sd1"),
    "KohakuBlueleaf__LyCORIS__smart_falcon_8_lokr.safetensors": ("kohya", "sd1"),
    "catundchat__stable-diffusion-v1.5-lora__pytorch_lora_weights.safetensors": (
        "diffusers_attn_processor",
        "sd1",
    ),
    "cloneofsimo__lora__analog_svd_rank4.safetensors": ("cloneofsimo", "sd1"),
    "leighwoods__public-loras__lora.safetensors": ("peft", "flux"),
    "timohavdk__sd-lora__2100-lora.safetensors": ("diffusers_lora_layer", "sd1"),
}
