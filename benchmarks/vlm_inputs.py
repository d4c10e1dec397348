"""Example inputs with images for tiny vision-language models (issue 44, item 6: the benchmark runs what users run).

Two layouts cover the matrix's VLMs: square pixel images with one placeholder token per image feature (LLaVA,
PaliGemma, Gemma-3, ...: ``pixel_values [B, 3, S, S]``; SmolVLM/Idefics3: ``[B, 1, 3, S, S]``, one token per
scale_factor² features) and flattened patches with a (t, h, w) grid per image
(Qwen2-VL, Qwen2.5-VL, GLM-4V, ...: ``pixel_values [Σ t·h·w, C·T·P·P]``, ``image_grid_thw``). The special tokens
are moved into the tiny 128-token vocabulary and the text is drawn above them, so every placeholder is one the
model expects. A model whose forward refuses the batch is run text only and its row says why.
"""

from __future__ import annotations

import torch

#: Special token ids inside the tiny vocabulary; text tokens are drawn from TEXT_FROM up.
IMAGE, START, END, VIDEO, TEXT_FROM = 5, 6, 7, 8, 12
_IMAGE_KEYS = ("image_token_id", "image_token_index")
_START_KEYS = ("vision_start_token_id", "image_start_token_id", "boi_token_index", "boi_token_id")
_END_KEYS = ("vision_end_token_id", "image_end_token_id", "eoi_token_index", "eoi_token_id")
_VIDEO_KEYS = ("video_token_id", "video_start_token_id", "video_end_token_id")
#: Grid images: 4 × 4 patches, merged 2 × 2 into 4 tokens where the model merges.
GRID = 4


def _move_tokens(config) -> tuple[bool, bool]:
    """Special ids moved into the vocabulary; (has a start token, has an end token)."""
    has = {}
    for keys, value in ((_IMAGE_KEYS, IMAGE), (_START_KEYS, START), (_END_KEYS, END)):
        for k in keys:
            if getattr(config, k, None) is not None:
                setattr(config, k, value)
                has[value] = True
    for i, k in enumerate(_VIDEO_KEYS):
        if getattr(config, k, None) is not None:
            setattr(config, k, VIDEO + i)
    return START in has, END in has


def image_batch(config, seed: int = 0) -> dict | None:
    """Two sequences, each with one image between 2 and 8 text tokens, for ``config`` (changed in place: its
    special token ids, and a projection width or token count the tiny sizes left unmatched); None when the config
    names no image token or no vision size."""
    vision = getattr(config, "vision_config", None)
    if vision is None or not any(getattr(config, k, None) is not None for k in _IMAGE_KEYS):
        return None
    gen = torch.Generator().manual_seed(seed)
    start, end = _move_tokens(config)
    text = config.get_text_config()
    if getattr(config, "projection_dim", None):  # PaliGemma projects the vision features to this width
        config.projection_dim = vision.projection_dim = text.hidden_size
    merge = getattr(vision, "spatial_merge_size", None)
    extra: dict = {}
    if merge:  # Qwen2-VL layout: flattened patches and a grid per image
        patch, frames = vision.patch_size, getattr(vision, "temporal_patch_size", 1) or 1
        channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None) or 3
        n = GRID * GRID // (merge * merge)
        extra = {"pixel_values": torch.randn(2 * GRID * GRID, channels * frames * patch * patch, generator=gen),
                 "image_grid_thw": torch.tensor([[1, GRID, GRID]] * 2)}
    else:
        size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
        if not isinstance(size, int) or not isinstance(patch, int):
            return None
        n = (size // patch) ** 2
        if getattr(config, "mm_tokens_per_image", None):  # Gemma-3 pools the patches to this many tokens
            config.mm_tokens_per_image = n = 4
        pixels = torch.randn(2, getattr(vision, "num_channels", 3), size, size, generator=gen)
        if getattr(config, "scale_factor", None):  # Idefics3 / SmolVLM: [B, images, C, S, S], pixel-shuffled tokens
            n //= config.scale_factor ** 2
            pixels = pixels[:, None]
        extra = {"pixel_values": pixels}
    image = [START] * start + [IMAGE] * n + [END] * end
    ids = torch.cat([torch.randint(TEXT_FROM, text.vocab_size, (2, 2), generator=gen), torch.tensor([image] * 2),
                     torch.randint(TEXT_FROM, text.vocab_size, (2, 8), generator=gen)], 1)
    return {"input_ids": ids, **extra, **_token_types(config, ids, grid=bool(merge))}


def _token_types(config, ids: torch.Tensor, grid: bool) -> dict:
    """The token-type inputs a model requires when training: Gemma-3 and PaliGemma mark image tokens
    (``token_type_ids``); grid-layout models mark each token's modality for their 3-d RoPE (``mm_token_type_ids``:
    text 0, image 1)."""
    kind = config.model_type
    if kind in ("gemma3", "paligemma"):
        return {"token_type_ids": (ids == IMAGE).long() if kind == "gemma3" else torch.zeros_like(ids)}
    return {"mm_token_type_ids": (ids == IMAGE).int()} if grid else {}
