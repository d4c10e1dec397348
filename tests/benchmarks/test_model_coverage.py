"""benchmarks/model_coverage.py on a fixed subset of Hugging Face model types (CI runs these, the full table is
the benchmark's): each is built tiny, patched with InvAct, trained beside the stock model. Every activation and norm
module is rewritten or named in a skip, the saved bytes fall, InvAct trains within 1e-5."""

import json
import runpy
import subprocess
import sys

import pytest
from _helpers import ROOT
from _once import once_per_run

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # 17 models patched and trained, 13 compiled: about 4 min of one core; CI runs it
COVERAGE = runpy.run_path(str(ROOT / "benchmarks" / "model_coverage.py"))
#: llama's block with other norm classes or scales (mistral, gemma: 1 + w, qwen3: QK-norms), a fused gate/up (phi3),
#: post-LN (bert, roberta), T5 (no mean, no bias; ReLU), ViT and GPT-2 (Conv1D); post-sub-layer norms read only by
#: the residual add (glm4), ReLU² (nemotron, exact table), Mistral's code under another name (ministral), and a
#: vision-language models run with images, whose top-level forwards count image tokens with .item() (llava; gemma3's
#: SigLIP tower with pooled image tokens; qwen2_5_vl's flattened patches on a grid), and an MoE whose
#: 3-d-parameter experts get the exact gate (qwen3_moe); SmolVLM with its images ([B, 1, C, S, S] pixels), whose vision
#: tower hands its final norm a non-contiguous input and whose connector .view()s the result (issue 59).
SUBSET = ("llama", "gemma", "qwen3", "phi3", "bert", "roberta", "t5", "vit", "gpt2", "glm4", "nemotron", "ministral",
          "llava", "gemma3", "qwen2_5_vl", "qwen3_moe", "smolvlm")
VISION_LANGUAGE = ("llava", "gemma3", "qwen2_5_vl")
#: The models also compiled (two torch.compile traces each, 4–20 s apiece on the CPU), one per kind of code: left
#: out are Mistral's code under another name (ministral), BERT's (roberta), and two of the four vision-language
#: models (gemma3, qwen2_5_vl: 42 s each; llava and smolvlm keep the images' graph breaks under compile).
COMPILED = tuple(n for n in SUBSET if n not in ("ministral", "roberta", "gemma3", "qwen2_5_vl"))


#: Run in a fresh interpreter: prints the rows as JSON on its last line.
_MEASURE = """
import json, runpy, sys
coverage = runpy.run_path(sys.argv[1])
jobs = {j[0]: j for j in coverage["model_types"]()}
compiled = set(sys.argv[2].split(","))
print(json.dumps({name: coverage["measure"](*jobs[name], compiled=name in compiled) for name in sys.argv[3:]},
                 default=str))
"""


@pytest.fixture(scope="session")
def rows(tmp_path_factory):
    """The rows measured in a fresh Python process, as the benchmark measures each model in a fresh worker: a
    rewrite's proof reads torch._dynamo's graph breaks, and in a pytest worker that ran other tests before (CI's
    gw1 once) LLaVA had 4 of its 8 norms rewritten where every fresh process finds 8; torch._dynamo.reset() did not
    restore it. The test checks the patch, not what earlier tests leave in the process. Measured once per run
    (``_once.once_per_run``: about 5 min, which worksteal had a module fixture spend three times)."""
    def measure():
        done = subprocess.run([sys.executable, "-c", _MEASURE, str(ROOT / "benchmarks" / "model_coverage.py"),
                               ",".join(COMPILED), *SUBSET], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    return once_per_run(tmp_path_factory, "model_coverage_rows", measure)


@pytest.mark.parametrize("name", SUBSET)
def test_every_module_is_rewritten_or_reported_and_nothing_grows(rows, name):
    row = rows[name]
    assert "error" not in row and "train_error" not in row, row
    assert row["unreported"] == [], row
    assert row["saving"] > 0.05, row
    assert row["train_difference"] <= 1e-6 and row["forward_difference"] <= 1e-5, row  # issue 43: 1e-6


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_the_patch_never_saves_more_than_compiled_stock(rows, name):
    """Both compiled (the partitioner's saved tensors): the patched model saves at most what stock saves (issue 43:
    the norms run their stock forward there, the drop-ins keep their custom ops)."""
    row = rows[name]
    assert "compile_error" not in row and row["compiled_saving"] >= 0, row


def test_blocks_like_llamas_save_within_five_points_of_it(rows):
    llama = rows["llama"]["saving"]
    for name in ("gemma", "phi3", "glm4", "ministral", "qwen3"):
        assert rows[name]["saving"] > llama - 0.05, (name, rows[name]["saving"], llama)


def test_post_ln_encoders_get_ms_ln(rows):
    for name in ("bert", "roberta"):
        assert rows[name]["norms_rewritten"] >= 4, rows[name]


def test_relu_squared_gets_its_exact_table(rows):
    assert rows["nemotron"]["acts_swapped"] == rows["nemotron"]["acts"] == 2, rows["nemotron"]


@pytest.mark.parametrize("name", VISION_LANGUAGE)
def test_vision_language_models_run_with_images_get_both_towers_within_five_points_of_llama(rows, name):
    """Issue 44: with real pixel inputs (their forwards count image tokens with .item()), every norm of both towers
    is rewritten (a branch on tensor values changes no reader's value) and the saving is within 5 points of
    llama's."""
    row = rows[name]
    assert row["input"] == "text and images", row
    assert row["norms_rewritten"] == row["norms"] and row["unreported"] == [], row["skipped"]
    assert row["saving"] > rows["llama"]["saving"] - 0.05, row


def test_smolvlm_with_images_is_patched_and_stock(rows):
    """Issue 59: the post-layernorm's output layout is the stock module's (it is the stock forward's value), so the
    connector's .view works and SmolVLM run with its images is patched whole: every norm rewritten, the forward equal
    to stock bit for bit, the saving positive."""
    row = rows["smolvlm"]
    assert row["input"] == "text and images", row
    assert row["norms_rewritten"] == row["norms"] and row["skipped"] == [], row
    assert row["forward_difference"] == 0.0 and row["saving"] > 0.05, row


def test_the_table_says_what_was_left_and_why(rows):
    text = COVERAGE["markdown"](list(rows.values()), {"transformers": "x", "torch": "y"})
    assert text.count("\n| ") == len(SUBSET) + 1 and "| t5 | seq2seq |" in text
    liger = COVERAGE["liger_markdown"](list(rows.values()))
    assert "| llava (text and images) |" in liger and "| t5 |" not in liger


_TWICE = """
import json, runpy, sys, torch
junk = [torch.empty(int(n)) for n in sys.argv[2:]]  # another process's allocations before the count
coverage = runpy.run_path(sys.argv[1])
jobs = {j[0]: j for j in coverage["model_types"]()}
row = coverage["measure"](*jobs["deepseek_v3"], eager_only=True)
print(json.dumps([row["saved_bytes"], row["saving"]]))
"""


def test_a_models_saving_is_the_same_in_two_processes():
    """Issue 44, cause 5: deepseek_v3's stock bytes came out 472,724 or 439,956 in different processes (a storage
    freed during the forward lent its address to a new one, which went uncounted). Counted by storage identity, two
    processes with different allocations before the count agree byte for byte."""
    runs = []
    for junk in ([], ["1000", "77777", "3"]):
        done = subprocess.run([sys.executable, "-c", _TWICE, str(ROOT / "benchmarks" / "model_coverage.py"), *junk],
                              capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1] and runs[0][1] > 0.25, runs


def test_the_callers_pixels_saved_by_a_patch_embedding_are_left_out_of_the_saving():
    """A vision tower's patch embedding saves its input, the caller's pixels, which exist anyway like the
    parameters (in a tiny Qwen2.5-VL 12 % of the stock count, pulling its saving 4 points down): the table's
    counts leave exactly the batch's saved storages out."""
    import torch
    from torch import nn

    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.ln, self.fc = nn.Conv2d(3, 8, 4, stride=4), nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, pixel_values):
            return (self.fc(self.ln(self.embed(pixel_values).flatten(2).transpose(1, 2))),)

    pixels = torch.randn(2, 3, 16, 16)
    assert COVERAGE["inputs_saved"](Tower(), {"pixel_values": pixels}) == pixels.untyped_storage().nbytes()
    with torch.no_grad():
        assert COVERAGE["inputs_saved"](Tower().requires_grad_(False), {"pixel_values": pixels}) == 0
