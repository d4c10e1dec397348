"""Which Hugging Face models ``patch_model`` covers: every model type of the installed ``transformers`` with a
causal-LM, masked-LM, seq2seq, image- or audio-classification head, built tiny from its default config (random
init, fp32), patched with InvAct on an example batch, then trained 10 AdamW steps beside the stock model.

    python benchmarks/model_coverage.py [--only llama,phi3] [--jobs 2] [--docs docs/models.md]

(``--only`` replaces those model types' rows in the results file and keeps the others.)

Per model: activation-like and norm-like modules, how many were rewritten (activations swapped, gated MLPs fused,
norms made MS-norms), every skip with its reason, the modules neither rewritten nor named in a skip ("unreported":
must be none), the max forward difference, the measured saving of saved-for-backward bytes, and the max relative
loss difference after 10 training steps. Writes ``model_coverage.json`` and the docs page's table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # run by path (runpy, a worker): its sibling modules
from vlm_inputs import image_batch  # noqa: E402

#: Heads in order of preference: a model type is built once, with the first head it has.
HEADS = (("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"), ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
         ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
         ("image-cls", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
         ("audio-cls", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"),
         ("image-text-to-text", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"))
#: The model types Liger-Kernel patches (its ``MODEL_TYPE_TO_APPLY_LIGER_FN``, Nov 2026): issue 32 asks for every one
#: that transformers has; the docs page lists each with its row.
LIGER_FAMILIES = (
    "deepseek_v3", "deepseek_v4", "exaone4", "falcon_h1", "gemma", "gemma2", "gemma3", "gemma3_text", "gemma4",
    "gemma4_text", "glm4", "glm4v", "glm4v_moe", "gpt_oss", "granite", "hunyuan_v1_dense", "hunyuan_v1_moe",
    "internvl", "llama", "llama4", "llama4_text", "llava", "ministral", "mistral", "mixtral", "mllama",
    "mllama_text_model", "muse_glimmer", "nemotron", "olmo2", "olmo3", "paligemma", "phi3", "pixtral", "qwen2",
    "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl", "qwen2_vl_text", "qwen3", "qwen3_5", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe", "qwen3_vl_moe_text",
    "qwen3_vl_text", "smollm3", "smolvlm")
#: Config attributes set (where the config has them) to make any model tiny.
TINY = {"hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32, "intermediate_size": 64, "ffn_dim": 64,
        "d_ff": 64, "n_inner": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
        "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2, "num_attention_heads": 4, "n_head": 4,
        "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "d_kv": 8, "vocab_size": 128, "max_position_embeddings": 64, "n_positions": 64,
        "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "image_size": 32, "patch_size": 8, "num_channels": 3, "kv_lora_rank": 16, "q_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "rotary_dim": 8, "n_group": 1, "depth": 2,
        "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8, "out_hidden_size": 32,
        "projector_hidden_size": 64,
        "topk_group": 1}
#: Sizes a config may leave None, to be derived from the others at full size (Ministral's head_dim, Nemotron's
#: key/value heads): the derivation is for the full model, so the tiny one sets them.
DERIVED_WHEN_NONE = ("head_dim", "num_key_value_heads")
#: The fallback when a model cannot be built from :data:`TINY` (its sizes depend on each other in ways a generic
#: shrink breaks): its own widths, 2 layers, a small vocabulary.
DEPTH_ONLY = {k: v for k, v in TINY.items() if k in (
    "num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers", "num_decoder_layers",
    "vocab_size", "max_position_embeddings", "n_positions", "image_size")}
#: The largest model built (the fallback keeps a model's own widths: DeepSeek-V3's are 7168).
MAX_PARAMETERS = 30_000_000
#: Training steps compared with the stock model (issue 32: InvAct training stays within 1e-5 relative).
STEPS = 10


def model_types() -> list[tuple[str, str, str]]:
    """(model type, head, class name) for every model type with one of :data:`HEADS`, first head first."""
    import transformers.models.auto.modeling_auto as auto

    seen: dict[str, tuple[str, str, str]] = {}
    for head, mapping in HEADS:
        for model_type, cls in getattr(auto, mapping).items():
            seen.setdefault(model_type, (model_type, head, cls if isinstance(cls, str) else cls[0]))
    return sorted(seen.values())


#: Sizes a generic shrink leaves too large or inconsistent for one model type, set after :data:`TINY` (only where
#: the type is built with TINY): GraniteMoE-Hybrid's Mamba heads (d_head · heads = 2 · hidden) and one attention
#: layer (an all-Mamba stack has no layer a cache can take its length from).
OWN_SIZES = {"granitemoehybrid": {
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16, "shared_intermediate_size": 32,
    "layer_types": ["linear_attention", "full_attention"]}}


def tiny_config(model_type: str, sizes: dict = TINY):
    """The model type's default config with every size in ``sizes`` it has, sub-configs too; per-layer lists cut
    to the new layer count; special token ids kept inside the vocabulary; then :data:`OWN_SIZES`."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    _shrink(config, sizes)
    for key, value in OWN_SIZES.get(model_type, {}).items() if sizes is TINY else ():
        setattr(config, key, value)
    return config


def _get(config, key: str):
    """config.key, or None (Gemma-4 raises on per-layer attributes read globally)."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - an attribute that cannot be read globally is not one to shrink
        return None


def _shrink(config, sizes: dict, depth: int = 0) -> None:
    from transformers import PretrainedConfig

    layers = next((_get(config, k) for k in ("num_hidden_layers", "num_layers", "n_layer")
                   if isinstance(_get(config, k), int)), None)
    keep = _kept_layers(config, layers)
    for key, value in sizes.items():
        unset = key in DERIVED_WHEN_NONE and key in vars(config) and _get(config, key) is None
        if unset or isinstance(_get(config, key), int) and not isinstance(_get(config, key), bool):
            try:
                setattr(config, key, len(keep) if keep and key == "num_hidden_layers" else value)
            except AttributeError:  # a derived, read-only property (Falcon's head_dim)
                pass
    if isinstance(_get(config, "kv_lora_rank"), int):  # multi-head latent attention: one key/value per head, and a
        if isinstance(_get(config, "num_key_value_heads"), int):  # query/key width derived from its two parts
            config.num_key_value_heads = config.num_attention_heads
        if isinstance(_get(config, "qk_head_dim"), int):
            config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    rope = _get(config, "rope_parameters")
    multimodal = any(tag in str(_get(config, "model_type")) for tag in ("_vl", "4v"))  # qwen2_vl, glm4v
    if isinstance(rope, dict) and (isinstance(rope.get("mrope_section"), list) or multimodal):
        # (t, h, w) sections of the rotary half (default [16, 24, 24], written into the modeling code, not the config)
        factor = rope.get("partial_rotary_factor") or _get(config, "partial_rotary_factor") or 1.0
        half = int(sizes["head_dim"] * factor) // 2
        rope["mrope_section"] = [half // 3, half // 3, half - 2 * (half // 3)]
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and layers and len(value) == layers and key not in ("architectures",):
            setattr(config, key, [value[i] for i in keep] if keep else value[:TINY["num_hidden_layers"]])
        elif isinstance(value, PretrainedConfig) and depth < 3:
            _shrink(value, sizes, depth + 1)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                "cls_token_id", "mask_token_id"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v >= TINY["vocab_size"]:
            setattr(config, key, 1)
        elif isinstance(v, list):
            setattr(config, key, [t if t < TINY["vocab_size"] else 1 for t in v])
    if hasattr(config, "num_labels"):
        config.num_labels = 2


def _kept_layers(config, layers: int | None) -> list[int] | None:
    """The layer indices a tiny model keeps when its layers are of several types (Qwen3-Next's linear and full
    attention): the first of each type, then the first ones, two at least; None when every layer is alike."""
    types = _get(config, "layer_types")
    if not (isinstance(types, list) and layers and len(types) == layers and len(set(types)) > 1):
        return None
    first = list(dict.fromkeys(types))
    keep = sorted({types.index(t) for t in first} | set(range(max(0, TINY["num_hidden_layers"] - len(first)))))
    return keep


def example_batch(head: str, config) -> tuple[dict, dict]:
    """(example input, its labels) for one head: 2 sequences of 12 tokens, 2 images or 2 clips."""
    gen = torch.Generator().manual_seed(0)
    if head == "image-text-to-text":  # text only (image_batch adds images where the model's count is known)
        head = "causal-lm"
    if head in ("causal-lm", "masked-lm", "seq2seq"):
        vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", 128)
        ids = torch.randint(3, vocab, (2, 12), generator=gen)
        batch = {"input_ids": ids}
        if head == "seq2seq":
            batch["decoder_input_ids"] = ids[:, :8].clone()
            return batch, {"labels": ids[:, :8].clone()}
        return batch, {"labels": ids}
    labels = {"labels": torch.tensor([0, 1])}
    if head == "image-cls":
        size = getattr(config, "image_size", 32)
        size = size if isinstance(size, int) else 32
        channels = getattr(config, "num_channels", 3)
        return {"pixel_values": torch.randn(2, channels, size, size, generator=gen)}, labels
    bins = getattr(config, "num_mel_bins", None)
    if bins:
        return {"input_features": torch.randn(2, bins, 3000, generator=gen)}, labels
    return {"input_values": torch.randn(2, 4000, generator=gen)}, labels


def _with_images(config, class_name: str, batch: dict, labels: dict):
    """(config, batch, labels, stock model or None, what the input is): a vision-language model run with images
    (:mod:`vlm_inputs`) where its forward takes them, else text only with the refusal said."""
    import transformers

    images_config = copy.deepcopy(config)
    images = image_batch(images_config)
    if images is None:
        return config, batch, labels, None, "text only (no image token or vision size in its config)"
    try:
        torch.manual_seed(0)
        stock = getattr(transformers, class_name)(images_config).float()
        with torch.no_grad():
            stock.eval()(**images)
    except Exception as err:  # noqa: BLE001 - said in the row, and the text-only run measured instead
        return config, batch, labels, None, f"text only (images refused: {type(err).__name__}: {str(err)[:120]})"
    return images_config, images, {"labels": images["input_ids"]}, stock, "text and images"


def _loss(model, batch: dict, labels: dict) -> torch.Tensor:
    out = model(**batch, **labels)
    loss = getattr(out, "loss", None)
    if loss is None:
        logits = out.logits if hasattr(out, "logits") else out[0]
        loss = logits.float().square().mean()
    return loss


def inputs_saved(model, batch: dict) -> int:
    """Bytes of the batch's own storages that one training forward saves for backward (a vision tower's patch
    embedding keeps the pixels): they exist anyway, like the parameters, so the table's saving leaves them out of
    both counts (in a tiny Qwen2.5-VL they are 12 % of the stock count). The batch stays alive throughout, so its
    storages keep their identities."""
    mine = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in batch.values() if torch.is_tensor(t)}
    kept = set()

    def pack(t: torch.Tensor):
        if (k := t.untyped_storage()._cdata) in mine:
            kept.add(k)
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(model, batch, {})
    return sum(mine[k] for k in kept)


def compiled_saved_bytes(model, batch: dict, labels: dict) -> int:
    """Bytes saved for backward by one training forward under torch.compile, by storage identity: inductor's
    min-cut partitioner without its code generation (``aot_eager_decomp_partition``: the same saved tensors);
    parameters and the batch, which exist anyway, not counted (as :func:`~.common.saved_on_example`
    counts the eager saving)."""
    from approxbp.kernels.ops.saved import saved_bytes

    torch._dynamo.reset()
    run = torch.compile(model.train(), backend="aot_eager_decomp_partition")
    torch.manual_seed(0)
    inputs = [t for t in (*batch.values(), *labels.values()) if torch.is_tensor(t)]  # the caller's, as parameters
    return saved_bytes(lambda: _loss(run, batch, labels), exclude=list(model.parameters()) + inputs)


def _train(model, batch: dict, labels: dict) -> list[float]:
    import random

    import numpy as np

    torch.manual_seed(0)  # dropout; numpy and random: wav2vec2-style time masks
    np.random.seed(0)
    random.seed(0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, batch, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def inventory(model) -> tuple[list[str], list[str]]:
    """(activation-like module paths, norm-like module paths) of a stock model."""
    from approxbp.kernels.rewrite.norm_forms import is_norm_candidate
    from approxbp.kernels.rewrite.patch import ACTIVATION_LIKE

    acts = [n for n, m in model.named_modules() if n and next(m.children(), None) is None
            and any(f.lower() in type(m).__name__.lower() for f in ACTIVATION_LIKE)]
    norms = [n for n, m in model.named_modules() if n and is_norm_candidate(m)]
    return acts, norms


def _mentioned(name: str, skipped: list[str]) -> bool:
    from approxbp.kernels.rewrite.patch import path_pattern

    pattern = path_pattern(name)
    return any(name in s or pattern in s for s in skipped)


def measure(model_type: str, head: str, class_name: str, eager_only: bool = False, compiled: bool = True) -> dict:
    """One row of the table (a row with ``error`` when the tiny model cannot be built or run); ``eager_only``: the
    patch and its eager saving, without the compiled counts and the training run; ``compiled=False``: without the
    compiled counts (two torch.compile traces, 4–20 s each on the CPU)."""
    import transformers
    from approxbp.kernels import patch_model

    row = {"model_type": model_type, "head": head, "class": class_name}
    # a causal-LM head that cannot take its composite config (Llama-4, Qwen3.5) is given the text model's
    for sizes, text in ((TINY, False), (TINY, True), (DEPTH_ONLY, False)):
        try:
            config = tiny_config(model_type, sizes)
            if text and (head != "causal-lm" or config.get_text_config() is config):
                continue
            config = config.get_text_config() if text else config
            with torch.device("meta"):  # sized before anything is allocated
                params = sum(p.numel() for p in getattr(transformers, class_name)(config).parameters())
            if params > MAX_PARAMETERS:
                raise ValueError(f"{params / 1e6:.0f} M parameters at these sizes (over {MAX_PARAMETERS / 1e6:.0f} M)")
            batch, labels = example_batch(head, config)
            stock = None
            if head == "image-text-to-text" or (head == "causal-lm" and hasattr(config, "vision_config")):
                config, batch, labels, stock, row["input"] = _with_images(config, class_name, batch, labels)
            if stock is None:
                torch.manual_seed(0)
                stock = getattr(transformers, class_name)(config).float()
                with torch.no_grad():
                    stock.eval()(**batch)
            row["sizes"] = ("tiny" if sizes is TINY else "2 layers, own widths") + (", text model" if text else "")
            break
        except Exception as err:  # noqa: BLE001 - a model we cannot build small is a row that says so
            error = f"stock small model: {type(err).__name__}: {' '.join(str(err).split())[:200]}"
            if isinstance(err, TimeoutError):
                return {**row, "error": error}
    else:
        return {**row, "error": error}
    acts, norms = inventory(stock)
    ours = copy.deepcopy(stock)
    try:
        report = patch_model(ours, family="invact", example_input=batch)
    except Exception as err:  # noqa: BLE001
        return {**row, "acts": len(acts), "norms": len(norms),
                "error": f"patch_model: {type(err).__name__}: {' '.join(str(err).split())[:300]}"}
    glu_acts = [n for n in acts if any(n.startswith(report.subject(g) + ".") for g in report.glus)]
    done = report.rewritten() | set(glu_acts)
    unreported = [n for n in acts + norms if n not in done and not _mentioned(n, report.skipped)]
    before, after = report.saved_bytes or (0, 0)
    if report.saved_bytes:  # the batch is the caller's (a patch embedding saves the pixels): not an activation
        before, after = before - inputs_saved(stock, batch), after - inputs_saved(ours, batch)
    row.update(acts=len(acts), acts_swapped=len(report.activations), glus=len(report.glus), acts_in_glus=len(glu_acts),
               norms=len(norms), norms_rewritten=len(report.norms), skipped=report.skipped, unreported=unreported,
               forward_difference=report.max_output_difference, saved_bytes=[before, after],
               saving=(1 - after / before) if before else None)
    if not eager_only:
        if compiled:
            _compile(row, stock, ours, batch, labels)
        _train_beside_stock(row, stock, ours, batch, labels)
    return row


def _compile(row: dict, stock, ours, batch: dict, labels: dict) -> None:
    """The row's compiled saved bytes (stock, patched), or why dynamo could not run it."""
    try:
        compiled = [compiled_saved_bytes(m, batch, labels) for m in (stock, ours)]
        row.update(compiled_saved_bytes=compiled, compiled_saving=(1 - compiled[1] / compiled[0]) if compiled[0]
                   else None)
    except Exception as err:  # noqa: BLE001 - a model dynamo cannot run is said in its row
        row["compile_error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"


def _train_beside_stock(row: dict, stock, ours, batch: dict, labels: dict) -> None:
    """The row's training difference from stock (a failure said in the row)."""
    try:
        start = copy.deepcopy(stock)
        ref, got = _train(stock, batch, labels), _train(ours, batch, labels)
        row["train_difference"] = _relative(ref, got)
        if row["train_difference"] > TRAIN_TOLERANCE:  # how much does the stock model's own run move?
            with torch.no_grad():
                gen = torch.Generator().manual_seed(1)
                for p in start.parameters():
                    p.mul_(1 + PERTURBATION * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            row["stock_sensitivity"] = _relative(ref, _train(start, batch, labels))
    except Exception as err:  # noqa: BLE001
        row["train_error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"


#: Work limit per model, in seconds of its worker (a state-space scan or a huge default sequence on the CPU).
PER_MODEL_S = 120


def _over_time(signum, frame):
    raise TimeoutError(f"over {PER_MODEL_S} s on this machine")


def _relative(ref: list[float], got: list[float]) -> float:
    return max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(ref, got))


#: InvAct training within this of stock (relative loss difference over :data:`STEPS`) is exact; beyond it the row
#: also gives the stock model's own sensitivity: its run from weights perturbed by :data:`PERTURBATION` relative.
TRAIN_TOLERANCE, PERTURBATION = 1e-5, 1e-6


#: Address space one model may add to its worker: one that would need more fails its row with a MemoryError
#: instead of the kernel killing the worker, which would end the whole run (GLM-5-Next's tiny config asks for tens
#: of GiB). Relative to what the worker has mapped already (workers are reused, and their mappings grow).
MODEL_BYTES = 8 << 30


#: Models one worker measures before a fresh one takes over (a worker that compiled 100 models held 14 GB here).
TASKS_PER_WORKER = 4


def _measure_safely(job) -> dict:
    import os
    import resource
    import signal

    if os.path.exists("/proc/self/statm"):  # Linux: pages mapped now (elsewhere no limit is set)
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        soft = mapped + MODEL_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    signal.signal(signal.SIGALRM, _over_time)
    signal.alarm(PER_MODEL_S)
    try:
        torch.set_num_threads(1)
        return measure(*job)
    except Exception:  # noqa: BLE001 - one model's crash (or time-out) is its row, not the run's end
        return {"model_type": job[0], "head": job[1], "class": job[2],
                "error": "crashed: " + traceback.format_exc(limit=1).strip().splitlines()[-1][:200]}
    finally:
        signal.alarm(0)


def markdown(rows: list[dict], meta: dict) -> str:
    """The docs page's table."""
    ok = [r for r in rows if "error" not in r]
    off = [r for r in ok if (r.get("train_difference") or 0) > TRAIN_TOLERANCE]
    unexplained = [r for r in off if r["train_difference"] > 10 * r.get("stock_sensitivity", 0)]
    full = [r for r in ok if not r["unreported"] and r["acts_swapped"] + r["acts_in_glus"] == r["acts"]
            and r["norms_rewritten"] == r["norms"]]
    lines = [f"{len(rows)} model types (transformers {meta['transformers']}, torch {meta['torch']}); {len(ok)} built "
             f"and patched, {len(full)} with every activation and norm rewritten; "
             f"{sum(bool(r['unreported']) for r in ok)} with a module neither rewritten nor named in a skip; "
             f"{sum((r.get('saving') or 0) < 0 for r in ok)} whose saved bytes grow "
             f"({sum((r.get('compiled_saving') or 0) < 0 for r in ok)} compiled); {len(off)} whose 10-step InvAct "
             f"loss is more than {TRAIN_TOLERANCE:g} from stock, of which {len(unexplained)} by more than 10 × the "
             f"stock run's own change under a {PERTURBATION:g} perturbation of its weights.", "",
             "| model | head | activations swapped / fused in GLUs / all | norms rewritten / all | saving | "
             "saving compiled | forward diff | 10-step loss diff | skipped (first reason) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model_type']} | {r['head']} | — | — | — | — | — | — | not measured: "
                         f"{_cell(r['error'])} |")
            continue
        saving = "—" if r["saving"] is None else f"{100 * r['saving']:.1f} %"
        train = r.get("train_difference")
        train = f"{train:.1e}" if train is not None else _cell(r.get("train_error", "—"))
        if "stock_sensitivity" in r:
            train += f" (stock itself: {r['stock_sensitivity']:.1e})"
        first = _cell(r["skipped"][0]) if r["skipped"] else ""
        more = f" (+{len(r['skipped']) - 1} more)" if len(r["skipped"]) > 1 else ""
        lines.append(f"| {r['model_type']} | {r['head']} | {r['acts_swapped']} / {r['acts_in_glus']} / {r['acts']} | "
                     f"{r['norms_rewritten']} / {r['norms']} | {saving} | {_compiled_cell(r)} | "
                     f"{r['forward_difference']:.1e} | {train} | "
                     f"{first}{more} |")
    return "\n".join(lines) + "\n"


def _compiled_cell(r: dict) -> str:
    """The compiled saving (patched vs stock, both compiled), or why it was not measured."""
    if "compile_error" in r:
        return "not compiled: " + _cell(r["compile_error"])[:60]
    return "—" if r.get("compiled_saving") is None else f"{100 * r['compiled_saving']:.1f} %"


def liger_markdown(rows: list[dict]) -> str:
    """One line per Liger-Kernel model type (:data:`LIGER_FAMILIES`): its row's saving and what is left, or why it
    is not measured; types this transformers lacks are named once."""
    by_type = {r["model_type"]: r for r in rows}
    present = [t for t in LIGER_FAMILIES if t in by_type]
    covered = [t for t in present if "error" not in by_type[t] and not by_type[t]["unreported"]
               and (by_type[t]["saving"] or 0) > 0]
    lines = [f"Of Liger-Kernel's {len(LIGER_FAMILIES)} model types, {len(present)} are in this transformers; "
             f"{len(covered)} are built, patched and save memory with every module rewritten or reported. "
             f"Not in this transformers: {', '.join(t for t in LIGER_FAMILIES if t not in by_type) or 'none'}.", "",
             "| Liger model type | saving | activations / norms rewritten | left as they are (first reason) |",
             "|---|---|---|---|"]
    for t in present:
        r = by_type[t]
        if "error" in r:
            lines.append(f"| {t} | — | — | not measured: {_cell(r['error'])} |")
            continue
        left = _cell(r["skipped"][0]) + (f" (+{len(r['skipped']) - 1} more)" if len(r["skipped"]) > 1 else "") \
            if r["skipped"] else ""
        lines.append(f"| {t}{' (text and images)' if r.get('input') == 'text and images' else ''} | "
                     f"{100 * (r['saving'] or 0):.1f} % | {r['acts_swapped'] + r['acts_in_glus']} of {r['acts']} / "
                     f"{r['norms_rewritten']} of {r['norms']} | {left or 'nothing'} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:160]


def _rows(jobs: list, workers: int):
    """The rows, in order. A worker the kernel kills (out of memory, a crash in C++) breaks the pool: the first
    model without a row gets one saying so (with 2 workers it may be the neighbour of the one that crashed, which
    then crashes the next pool and gets its own row), and a new pool takes the rest."""
    from concurrent.futures.process import BrokenProcessPool

    done = 0
    while done < len(jobs):  # fresh workers every few models: compiled graphs and dynamo's caches grow a worker
        chunk = jobs[done:done + TASKS_PER_WORKER * workers]
        with ProcessPoolExecutor(workers) as pool:
            try:
                for row in pool.map(_measure_safely, chunk):
                    done += 1
                    yield row
            except BrokenProcessPool:
                job = jobs[done]
                done += 1
                yield {"model_type": job[0], "head": job[1], "class": job[2],
                       "error": "crashed: its worker process was killed (out of memory, or a crash in C++)"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=None, help="comma-separated model types (default: every one)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--docs", type=Path, default=None, help="write the table into this markdown page")
    p.add_argument("--from-results", action="store_true", help="with --docs: write the page from the results JSON "
                   "in --out, measuring nothing")
    args = p.parse_args()
    if args.from_results:
        saved = json.loads((args.out / "model_coverage.json").read_text(encoding="utf-8"))
        return _write_docs(args.docs, saved["rows"], saved["meta"])
    import transformers
    from approxbp.approximations.files import write_atomic
    from approxbp.kernels import patch_model  # noqa: F401 - imported once here, shared by every forked worker

    jobs = [j for j in model_types() if args.only is None or j[0] in args.only.split(",")]
    t0, rows = time.perf_counter(), []
    for row in _rows(jobs, args.jobs):
        rows.append(row)
        status = row.get("error", "")[:60] or (f"saving {100 * (row['saving'] or 0):.1f} %, "
                                              f"unreported {len(row['unreported'])}")
        print(f"[{len(rows)}/{len(jobs)} {time.perf_counter() - t0:.0f} s] {row['model_type']}: {status}",
              file=sys.stderr, flush=True)
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "steps": STEPS,
            "seconds": round(time.perf_counter() - t0)}
    rows = _merged(args.out / "model_coverage.json", rows) if args.only else rows
    write_atomic(args.out / "model_coverage.json", json.dumps({"meta": meta, "rows": rows}, indent=1,
                                                                default=lambda v: None if v is None or (
                                                                    isinstance(v, float) and math.isnan(v)) else v))
    return _write_docs(args.docs, rows, meta) if args.docs else 0


def _merged(results: Path, rows: list[dict]) -> list[dict]:
    """``--only``: the rows measured now in place of the same model types' rows in the results file, the others
    kept (the run's meta then describes the new rows only: its seconds are theirs)."""
    if not results.exists():
        return rows
    new = {r["model_type"]: r for r in rows}
    kept = json.loads(results.read_text(encoding="utf-8"))["rows"]
    out = [new.pop(r["model_type"], r) for r in kept]
    return out + list(new.values())


def _write_docs(page: Path, rows: list[dict], meta: dict) -> int:
    """The two generated parts of the docs page, between their markers."""
    from approxbp.approximations.files import write_atomic

    text = page.read_text(encoding="utf-8")
    for key, body in (("model_coverage", markdown(rows, meta)), ("liger", liger_markdown(rows))):
        start, end = f"<!-- {key}: start -->", f"<!-- {key}: end -->"
        head, _, rest = text.partition(start)
        text = head + start + "\n" + body + end + rest.partition(end)[2]
    write_atomic(page, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
