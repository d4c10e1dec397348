"""The models ``approxbp plan`` builds: a bundled or Hugging Face config (with ``key=value`` overrides), a
``module:factory`` of the user's, each with the inputs of its task; built on the meta/fake device without
initialisation."""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from approxbp.planner.tasks import build as build_task
from approxbp.planner.tasks import task_of

__all__ = ["bundled_configs", "CONFIG_KEYS", "CONFIGS", "hf_builder", "model_spec", "no_init"]


#: Short keys of ``llama:hidden=4096,layers=32,…`` → Hugging Face config fields.
CONFIG_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
               "intermediate": "intermediate_size", "vocab": "vocab_size", "kv_heads": "num_key_value_heads",
               "image": "image_size", "patch": "patch_size"}


#: Hugging Face configs of the papers' models, shipped so that a plan needs no download: hub id → file.
CONFIGS = Path(__file__).parent / "configs"


def bundled_configs() -> list[str]:
    """The hub ids whose configs ship with approxbp (``approxbp plan google/vit-base-patch16-224-in21k``)."""
    return sorted(p.stem.replace("--", "/") for p in CONFIGS.glob("*.json"))


def model_spec(text: str, task: str | None = None) -> Callable[[], tuple[nn.Module, Callable[[int, int], dict]]]:
    """MODEL as the CLI takes it → a builder of (model, inputs(batch, seq)). A Hugging Face config JSON file, the hub
    id of a config that ships with approxbp (:func:`bundled_configs`), or a model type, each optionally followed by
    ``:key=value,…`` overrides (``llama:hidden=4096,layers=32,heads=32,intermediate=11008,vocab=32000``;
    ``text_config.hidden_act=gelu`` sets a nested config's field); or
    ``module:package.module:factory`` (the factory returns the model, or (model, inputs(batch, seq))). ``task``:
    the head (:mod:`approxbp.planner.tasks`)."""
    if text.startswith("module:"):
        return _factory_spec(text)
    import transformers

    head, _, rest = text.partition(":")
    bundled = CONFIGS / (head.replace("/", "--") + ".json")
    source = bundled if "/" in head and bundled.is_file() else Path(head) if Path(head).suffix == ".json" else None
    if source is not None:
        fields = json.loads(source.read_text())
        kind = fields.pop("model_type", None)
        if kind is None:
            raise ValueError(f"{text}: a Hugging Face config needs its model_type")
    elif "/" in head:
        raise ValueError(f"{head}: no such config here (nothing is downloaded); give its config.json, or one of "
                         f"{', '.join(bundled_configs())}")
    else:
        kind, fields = head, {}
    typed = []
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{text}: expected key=value, got {item!r}")
        *parents, name = key.strip().split(".")  # text_config.hidden_act=gelu: a field of a nested config
        into = fields
        for parent in parents:
            into = into.setdefault(parent, {})
            if not isinstance(into, dict):
                raise ValueError(f"{text}: {key.strip()}: {parent} is not a nested config")
        field, parsed = CONFIG_KEYS.get(name, name), _config_value(value)
        into[field] = parsed
        typed.append((parents, field, key.strip(), parsed))
    _refuse_unknown_keys(text, kind, typed)
    try:
        config = transformers.AutoConfig.for_model(kind, **fields)
    except Exception as err:  # noqa: BLE001 - transformers' own validation errors, said in one line
        cause = " ".join(str(err).split())
        raise ValueError(f"{text}: transformers refused this config: {cause[-300:]}") from None
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        raise ValueError(f"{text}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv}); "
                         "set kv_heads= too")

    return hf_builder(config, task)


_MISSING = object()


def _refuse_unknown_keys(text: str, kind: str, typed: list) -> None:
    """Refuse a typed ``key=value`` that ``kind``'s config does not know (transformers keeps an unknown key as an
    attribute and builds the default-sized model, so ``llama:hiden=64`` would plan a 4096-wide model). Known: a
    field or attribute of the default config, or a key that changes some other field (``rope_theta`` →
    ``rope_parameters``) or none (``attn_implementation``, kept privately)."""
    import difflib

    import transformers

    try:
        default = transformers.AutoConfig.for_model(kind)
    except Exception:  # noqa: BLE001 - an unknown model type is refused with transformers' own words below
        return
    for parents, name, raw, value in typed:
        ref = default
        for parent in parents:
            ref = getattr(ref, parent, None)
        if ref is None or isinstance(ref, dict):
            continue
        known = ref.to_dict()
        if name in known or hasattr(ref, name):
            continue
        if not parents:
            with contextlib.suppress(Exception):
                changed = transformers.AutoConfig.for_model(kind, **{name: value}).to_dict()
                moved = {k for k in set(changed) | set(known) if changed.get(k, _MISSING) != known.get(k, _MISSING)}
                if moved != {name}:
                    continue
        near = difflib.get_close_matches(name, [*known, *CONFIG_KEYS], n=1)
        raise ValueError(f"{text}: {raw}: the {type(ref).__name__} has no field {name!r}"
                         + (f" (did you mean {near[0]!r}?)" if near else "")
                         + "; transformers would keep it unused and plan the default size")


def hf_builder(config, task: str | None = None) -> Callable[[], tuple[nn.Module, Callable[[int, int], dict]]]:
    """A builder of (the Hugging Face model of ``config`` with ``task``'s head (:func:`approxbp.planner.tasks.task_of`),
    inputs(batch, seq) with its labels); ``config`` and ``task`` are kept on it."""
    task = task_of(config, task)

    def build():
        return build_task(config, task)
    build.config, build.task = config, task
    return build


def _config_value(value: str):
    """A config value as written after ``key=``: JSON (numbers, true, "text", lists), else the bare text
    (``hidden_act=relu``)."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value.strip()


def _factory_spec(text: str):
    """``module:package.module:factory`` → a builder; import and type errors are said in one line."""
    parts = text.split(":", 2)
    if len(parts) != 3 or not all(parts[1:]):
        raise ValueError(f"{text}: expected module:package.module:factory")
    _, mod, fn = parts
    try:
        factory = getattr(importlib.import_module(mod), fn)
    except ImportError as err:
        raise ValueError(f"{text}: cannot import {mod} ({err})") from None
    except AttributeError:
        raise ValueError(f"{text}: {mod} has no {fn}") from None
    if not callable(factory):
        raise TypeError(f"{text}: {mod}.{fn} is not callable")

    def build():
        made = factory()
        model = made[0] if isinstance(made, tuple) and made else made
        if not isinstance(model, nn.Module) or (isinstance(made, tuple) and (len(made) != 2 or not callable(made[1]))):
            raise TypeError(f"{text}: the factory must return an nn.Module or (model, inputs(batch, seq)), got "
                            f"{type(made).__name__}")
        if isinstance(made, tuple):
            return made
        return made, lambda b, n: {"input": torch.randn(b, n, _width(made))}
    return build


def no_init():
    """Weight initialisation skipped (fake tensors have no values, and truncated-normal init reads them)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _width(model: nn.Module) -> int:
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        raise ValueError("module: factory returned a model without a Linear; return (model, inputs(batch, seq))")
    return first.in_features
