"""The head a planned model is built with, and the inputs and labels of one training step (``approxbp plan --task``).
Each task builds the Hugging Face model class that carries its head and gives labels, so the
model computes its own training loss (cross-entropy on the logits, CLIP's contrastive loss) as a training step does.

Without ``--task`` the head is the one the config's ``architectures`` names, else the family's natural
head: masked-lm for an encoder, causal-lm for a decoder, image-cls for a vision config. The sequence length is the
text's; an image's or a spectrogram's patches are fixed by the config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["build", "head_of", "Inputs", "Task", "task_of", "TASKS"]


Inputs = Callable[[int, int], dict]


@dataclass(frozen=True)
class Task:
    """A head: the transformers Auto class that builds it, the class-name suffix that names it in ``architectures``,
    and what one step's inputs are (:func:`inputs`)."""

    auto: str
    suffix: str
    inputs: str  # text, image, audio, text+image; auto: the config's kind
    labels: str  # tokens, one, span, contrastive, none


TASKS = {
    "base": Task("AutoModel", "Model", "auto", "none"),  # no head: the loss is the mean of the last hidden state
    "causal-lm": Task("AutoModelForCausalLM", "ForCausalLM", "text", "tokens"),
    "masked-lm": Task("AutoModelForMaskedLM", "ForMaskedLM", "text", "tokens"),
    "seq-cls": Task("AutoModelForSequenceClassification", "ForSequenceClassification", "text", "one"),
    "token-cls": Task("AutoModelForTokenClassification", "ForTokenClassification", "text", "tokens"),
    "qa": Task("AutoModelForQuestionAnswering", "ForQuestionAnswering", "text", "span"),
    "image-cls": Task("AutoModelForImageClassification", "ForImageClassification", "image", "one"),
    "audio-cls": Task("AutoModelForAudioClassification", "ForAudioClassification", "audio", "one"),
    "clip": Task("AutoModel", "CLIPModel", "text+image", "contrastive"),
}


def _is_vision(config) -> bool:
    return hasattr(config, "image_size") and hasattr(config, "patch_size")


def task_of(config, task: str | None = None) -> str:
    """The head a step is planned with (:func:`head_of`)."""
    return head_of(config, task)[0]


def head_of(config, task: str | None = None) -> tuple[str, str]:
    """(head, why): ``task`` if given, else the one the config's ``architectures`` names, else the family's natural
    head: image-cls for a vision config, masked-lm for an encoder (a model type with a masked-LM head that is not a
    decoder: BERT, RoBERTa, …), causal-lm otherwise."""
    if task is not None:
        if task not in TASKS:
            raise ValueError(f"--task {task!r}: expected one of {', '.join(TASKS)}")
        return task, "--task"
    for arch in getattr(config, "architectures", None) or ():
        named = [(len(t.suffix), name) for name, t in TASKS.items() if arch.endswith(t.suffix)]
        if named:
            return max(named)[1], f"named by the config's architectures: {arch}"
    if _is_vision(config):
        return "image-cls", "natural for a vision config: it names no architectures"
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    encoder = (getattr(config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES
               and not getattr(config, "is_decoder", False) and not getattr(config, "is_encoder_decoder", False))
    if encoder:
        return "masked-lm", "natural for an encoder: the config names no architectures"
    return "causal-lm", "natural for a decoder: the config names no architectures"


def _inputs_for(config, task: str) -> Inputs:
    """inputs(batch, seq) → the keyword arguments of one training step, labels included (all zeros: a fake or
    real step's memory does not depend on their values). ``ignores_seq`` is set where the sequence is fixed."""
    t = TASKS[task]
    vision = getattr(config, "vision_config", config)
    kind = t.inputs if t.inputs != "auto" else (
        "image" if _is_vision(config) else "audio" if hasattr(config, "num_mel_bins") else "text")

    def make(b: int, n: int) -> dict:
        import torch

        out: dict = {}
        if "text" in kind:
            out["input_ids"] = torch.zeros(b, n, dtype=torch.long)
        if "image" in kind:
            side = vision.image_size
            out["pixel_values"] = torch.randn(b, getattr(vision, "num_channels", 3), side, side)
        if kind == "audio":
            out["input_values"] = torch.randn(b, config.max_length, config.num_mel_bins)
        zeros = torch.zeros(b, dtype=torch.long)
        if t.labels == "tokens":
            out["labels"] = torch.zeros(b, n, dtype=torch.long)
        elif t.labels == "one":
            out["labels"] = zeros
        elif t.labels == "span":
            out["start_positions"], out["end_positions"] = zeros, zeros.clone()
        elif t.labels == "contrastive":
            out["return_loss"] = True
        return out

    make.ignores_seq = "text" not in kind
    return make


def build(config, task: str):
    """(the model of ``config`` with ``task``'s head, inputs(batch, seq))."""
    import transformers

    auto = getattr(transformers, TASKS[task].auto)
    try:
        model = auto.from_config(config)
    except ValueError as err:
        raise ValueError(f"--task {task}: transformers has no such head for {config.model_type} "
                         f"({' '.join(str(err).split())[:200]})") from None
    model.tie_weights()  # done by the weight init, which a fake run skips
    return model, _inputs_for(config, task)
