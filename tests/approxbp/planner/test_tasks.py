"""Heads, labels and the set-up options: every task builds its head and trains on its own loss,
the planner's fake step equals a real one byte for byte, LoRA-FA and bf16 adapters save what a real peft model
saves, and the bundled configs of the papers' models load."""

import json

import pytest
import torch
from approxbp.kernels.ops.saved import charged

from approxbp.planner import models as MD
from approxbp.planner import plan_step as PS
from approxbp.planner.request import Request
from approxbp.planner.tasks import TASKS, task_of
from approxbp.planner.training import OPTIMIZERS, TRAIN, Setup, optimizer_bytes

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
TINY_BERT = "bert:hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64,vocab_size=100"
TINY_VIT = ("vit:hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64,image_size=32,"
            "patch_size=8")
TINY_AST = ("audio-spectrogram-transformer:hidden_size=32,num_hidden_layers=2,num_attention_heads=4,"
            "intermediate_size=64,max_length=64,num_mel_bins=32")
TINY_CLIP = ("clip:text_config.hidden_size=32,text_config.intermediate_size=64,text_config.num_hidden_layers=2,"
             "text_config.num_attention_heads=4,text_config.vocab_size=100,vision_config.hidden_size=32,"
             "vision_config.intermediate_size=64,vision_config.num_hidden_layers=2,vision_config.num_attention_heads=4,"
             "vision_config.image_size=32,vision_config.patch_size=8,projection_dim=16")
LLAMA = "llama:hidden=64,layers=2,heads=4,intermediate=128,vocab=100"


@pytest.mark.parametrize("model, task", [
    (TINY_BERT, "base"), (TINY_BERT, "masked-lm"), (TINY_BERT, "seq-cls"), (TINY_BERT, "token-cls"), (TINY_BERT, "qa"),
    (LLAMA, "causal-lm"), (TINY_VIT, "image-cls"), (TINY_VIT, "base"), (TINY_AST, "audio-cls"), (TINY_CLIP, "clip"),
])
def test_each_task_trains_on_its_own_loss_and_plans_what_a_real_step_saves(model, task):
    build = MD.model_spec(model, task)
    net, inputs = build()
    out = net(**inputs(2, 8))
    head_loss = getattr(out, "loss", None)
    assert (head_loss is None) == (task == "base") and type(net).__name__.endswith(TASKS[task].suffix)
    setup = Setup(weights="fp32", task=task)
    real, fake = (PS.stepper(Request(model=model, setup=setup, fake=f))(2, 8) for f in (False, True))
    assert real.saved == fake.saved and real.activations > 0


def test_the_default_task_is_the_one_the_config_names():
    config = transformers.AutoConfig.for_model("bert", architectures=["BertForQuestionAnswering"])
    assert task_of(config) == "qa"
    assert task_of(transformers.AutoConfig.for_model("clip", architectures=["CLIPModel"])) == "clip"
    assert task_of(transformers.AutoConfig.for_model("vit")) == "image-cls"
    assert task_of(transformers.AutoConfig.for_model("llama")) == "causal-lm"
    with pytest.raises(ValueError, match="--task"):
        Setup(task="segmentation")


def _peft_llama(dtype, freeze_a: bool, adapters_in_base_dtype: bool):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                   vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0),
                                autocast_adapter_dtype=not adapters_in_base_dtype).train()
    for name, p in model.named_parameters():
        if freeze_a and "lora_A" in name:
            p.requires_grad_(False)  # LoRA-FA: A stays at its initialisation
    return model


@pytest.mark.parametrize("setup", [Setup(train="lora-fa", lora_targets="all-linear"),
                                   Setup(train="lora", lora_targets="all-linear", adapters="bf16"),
                                   Setup(train="lora-fa", lora_targets="all-linear", adapters="bf16")])
def test_lora_fa_and_adapter_dtypes_plan_what_a_real_peft_model_saves(setup):
    step = PS.stepper(Request(model=LLAMA, setup=setup, fake=False))(2, 16)
    model = _peft_llama(setup.dtype, setup.train == "lora-fa", setup.adapters == "bf16")
    ids = torch.zeros(2, 16, dtype=torch.long)
    saved = {}
    with charged(saved, list(model.parameters()), model):
        model(input_ids=ids, labels=ids)
    assert sum(saved.values()) == step.activations
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() * p.element_size() for p in trainable) == step.gradients
    assert PS.stepper(Request(model=LLAMA, setup=setup))(2, 16).saved == step.saved


def test_lora_fa_keeps_the_rank_r_projection_not_the_input():
    lora, fa = (PS.stepper(Request(model=LLAMA, setup=Setup(train=t, lora_targets="all-linear")))(2, 16)
                for t in ("lora", "lora-fa"))
    assert fa.activations < lora.activations and fa.gradients < lora.gradients


def test_paged_adamw_keeps_two_fp32_moments_whatever_the_parameter_dtype():
    p = [torch.empty(100, dtype=torch.bfloat16, device="meta")]
    assert optimizer_bytes(p, "paged-adamw") == 800 and optimizer_bytes(p, "adamw") == 400


def test_the_cli_offers_the_set_up_modules_choices():
    from approxbp.cli import build_parser

    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    choices = {a.dest: tuple(a.choices) for a in plan._actions if a.choices}
    assert choices["train"] == TRAIN and choices["optimizer"] == OPTIMIZERS and choices["task"] == tuple(TASKS)


def test_the_papers_configs_ship_and_load_without_a_download():
    ids = MD.bundled_configs()
    assert {"google/vit-base-patch16-224-in21k", "huggyllama/llama-7b", "FacebookAI/roberta-base",
            "openai/clip-vit-large-patch14"} <= set(ids)
    for hub_id in ids:
        fields = json.loads((MD.CONFIGS / (hub_id.replace("/", "--") + ".json")).read_text())
        assert fields["model_type"] and fields["architectures"]
    build = MD.model_spec("openai/clip-vit-large-patch14:text_config.hidden_act=gelu")
    assert build.config.text_config.hidden_act == "gelu" and build.config.vision_config.hidden_act == "quick_gelu"
    with pytest.raises(ValueError, match="nothing is downloaded"):
        MD.model_spec("meta-llama/Llama-3.1-8B")


def test_qlora_as_its_script_sets_it_up_plans_on_fake_tensors_what_real_ones_save():
    """QLoRA's script: NF4 base Linears computing in bf16 and casting back to their input's dtype, fp32 norms, bf16
    adapters, bf16 autocast: the fake step saves what the real one saves."""
    setup = Setup(weights="nf4", norms="fp32", autocast="bf16", train="lora", adapters="bf16",
                  lora_targets="all-linear", optimizer="paged-adamw")
    real, fake = (PS.stepper(Request(model=LLAMA, setup=setup, fake=f))(2, 16) for f in (False, True))
    assert real.saved == fake.saved and real.optimizer == 8 * real.gradients // 2
