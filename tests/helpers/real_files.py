"""The real adapter files under ../shared/realdata that the real-data tests read."""

from __future__ import annotations

# file -> (target components, expected families, expected reason kinds for what does not land)
REAL_FILES = {
    "Haseebae__Synthetic_dataset_generator_with_stable_diffusion__pytorch_lora_weights.safetensors": (
        "sd15",
        {"lora": 128},
        {},
    ),
    "JustinJiangNext__lora-2.0__pytorch_lora_weights.safetensors": ("sd2", {"lora": 128}, {}),
    "catundchat__stable-diffusion-v1.5-lora__pytorch_lora_weights.safetensors": ("sd15", {"lora": 128}, {}),
    "timohavdk__sd-lora__2100-lora.safetensors": ("sd15", {"lora": 128}, {}),
    "cloneofsimo__lora__analog_svd_rank4.safetensors": ("sd15", {"lora": 192}, {}),
    "leighwoods__public-loras__lora.safetensors": ("flux", {"lora": 4}, {}),
    "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors": ("sd15", {"lokr": 350}, {}),
    "KohakuBlueleaf__LyCORIS__smart_falcon_8_lokr.safetensors": ("sd15", {"lokr": 350}, {}),
}
