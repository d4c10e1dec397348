"""The papers' memory tables as plan commands (papers.paper_memory): every row is one `approxbp plan` command that
the CLI parses; the rows the paper fully states come out within its printed values' targets; the measured causes
given for the rows outside them hold; the committed results cover every row."""

import json
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from approxbp.cli import build_parser
from approxbp.papers import paper_memory as M
from approxbp.planner import models as MD
from approxbp.planner import plan as P
from approxbp.planner import plan_step as PS
from approxbp.planner import step_memory as SM
from approxbp.planner.request import Request, parse
from approxbp.planner.training import Setup

pytest.importorskip("transformers")
RESULTS = Path(__file__).parents[3] / "benchmarks" / "results" / "paper_memory.json"


def _group(table: str, setup: str) -> M.Group:
    return next(g for g in M.GROUPS if g.table == table and g.setup.startswith(setup))


def test_every_row_is_one_plan_command_on_a_shipped_config():
    parser = build_parser()
    for g in M.GROUPS:
        for use, _ in g.rows:
            args = parser.parse_args(shlex.split(M.command(g, use))[1:])
            assert args.command == "plan" and args.use == use
            assert args.model.partition(":")[0] in MD.bundled_configs()
            P.parse_use(use)
    tables = {g.table for g in M.GROUPS}
    assert tables == {f"Approx-BP Table {n}" for n in (1, 2, 3, 4, 9, 11)} | {"InvAct App. A.1"}


@pytest.mark.parametrize("table, setup", [pytest.param("Approx-BP Table 1", "ViT-B, LoRA r = 4 on q, v",
                                                       marks=pytest.mark.slow),
                                          ("Approx-BP Table 1", "ViT-B, LoRA-FA r = 4 on q, v"),
                                          ("InvAct App. A.1", "ViT-B")])
def test_rows_come_within_the_papers_printed_values(table, setup):
    rows = M.reproduce([_group(table, setup)])
    assert rows and all(r.within for r in rows), M.text(rows)


def test_clip_saves_what_the_paper_says_once_its_quick_gelu_is_a_gelu():
    """The cause given for CLIP's row: with GELU in place of quick_gelu, InvAct saves the paper's −23.4 % ± 1."""
    gelu = "openai/clip-vit-large-patch14:text_config.hidden_act=gelu,vision_config.hidden_act=gelu"
    plan = P.evaluate(Request(model=gelu, batch=1, seq=77, setup=Setup(weights="fp32", task="clip")), use="invact")
    change = 100 * (plan.after.activations / plan.before.activations - 1)
    assert abs(change - -23.4) < 1
    assert M.EXPLAINED[("InvAct App. A.1", _group("InvAct App. A.1", "CLIP").setup, "invact")]


def test_eager_attention_alone_overflows_the_4090_at_the_papers_longest_sequence():
    """The cause given for Table 9: at 1979 tokens, eager attention's scores plus the weights and optimizer states
    exceed 24 GiB, so no rewrite of norms or activations reaches that length."""
    setup = Setup(weights="nf4", train="lora", adapters="bf16", lora_targets="all-linear", optimizer="paged-adamw")
    step = PS.stepper(Request(model="huggyllama/llama-7b:attn_implementation=eager", setup=setup, lora_r=64))(1, 1979)
    attention = sum(v for k, v in step.saved.items() if k.endswith("self_attn"))
    assert attention + step.parameters + step.optimizer > 24 * 2**30


def test_the_committed_results_cover_every_row():
    data = json.loads(RESULTS.read_text())
    have = {(d["table"], d["setup"], d["use"]) for d in data["rows"]}
    assert have == {(g.table, g.setup, use) for g in M.GROUPS for use, _ in g.rows}


def test_reproduce_memory_prints_the_rows_and_fails_an_unexplained_one(monkeypatch, capsys):
    from approxbp.commands import reproduce

    group = _group("InvAct App. A.1", "ViT-B")
    monkeypatch.setattr(M, "GROUPS", (group,))
    monkeypatch.setattr(M.reproduce, "__defaults__", ((group,), None))
    assert reproduce.memory_rows(progress=False) == [(f"{group.table}, {group.setup}, InvAct", "within")]
    assert "paper -23.8 %" in capsys.readouterr().out
    wrong = M.Group(group.table, group.setup, group.command, group.what, group.unit, (("invact", -40.0),))
    monkeypatch.setattr(M.reproduce, "__defaults__", ((wrong,), None))
    assert reproduce.memory_rows(progress=False)[0][1] == "outside"


def _without_lora_dropout(group: M.Group) -> M.Group:
    assert "--lora-dropout 0.1" in group.command
    return replace(group, command=group.command.replace("--lora-dropout 0.1", "--lora-dropout 0"))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["LLaMA-7B", "LLaMA-13B"])
def test_table_3_rows_are_those_of_a_step_without_lora_dropout(model):
    """The cause given for Table 3's rows: on the authors' set-up (their lora_dropout 0.1) no row is within the
    targets; the same commands without LoRA dropout bring the exact, ReSiLU2 and MS-RMSNorm rows within (the combined
    row is the paper's non-additive one), and the dropout's copies and masks are what differs (66.4 KiB per token
    and block at 7B, 5.19 GiB at batch 4 × 640; 68,352 bytes by hand)."""
    group = _group("Approx-BP Table 3", model)
    authors, without = M.reproduce([group]), M.reproduce([_without_lora_dropout(group)])
    assert not any(r.within for r in authors), M.text(authors)
    assert [r.within for r in without] == [True, True, True, False], M.text(without)
    if model == "LLaMA-7B":
        by_hand = 35_584 + 2 * 2 * 4096 + 2 * 4096 + 2 * 4096  # masks; 2 more copies at q, k, v; 1 at gate/up; o
        assert (authors[0].ours - without[0].ours) * 2**30 == pytest.approx(by_hand * 32 * 4 * 640, rel=0.01)
        assert all(r.status == "explained" for r in authors)


@pytest.mark.parametrize("train, adapted", [("lora", "lora_A"), ("full", None)])
def test_ms_norm_consumers_share_one_z_where_hf_keeps_three_casts(train, adapted):
    """Why Tables 1 (all linear) and 2 come within the paper: under AMP Hugging Face's ViT-B keeps three fp16 casts
    of one fp32 LayerNorm output, one per q, k, v Linear (its lora_A when adapted), each b·n·d·2 bytes; the
    authors' ViT (LowMemoryBP experiments/vit_exp/model/{lora,partial}.py) has separate q, k, v too, but its Linear
    Functions save their input once, uncast. With MS-LN the three read the stock y and save the norm's z: nothing
    of their own, as in the authors' model."""
    group = _group("Approx-BP Table 1" if train == "lora" else "Approx-BP Table 2",
                   "ViT-B, LoRA r = 4 on all" if train == "lora" else "ViT-B, full")
    args = parse(shlex.split(M.command(group, "exact"))[2:])
    run = PS.stepper(replace(Request.from_args(args), traced=None))  # the forward's saved tensors
    exact, ms = run(64, 1), run(64, 1, None, True)
    cast = 64 * 197 * 768 * 2
    for name in ("q_proj", "k_proj", "v_proj"):
        key = f"vit.layers.1.attention.{name}" + (f".{adapted}" if adapted else "")
        weight_cast = (4 if adapted else 768) * 768 * 2  # and its own weight's fp16 cast (lora_A: r = 4 rows)
        assert exact.saved[key] == cast + weight_cast, (key, exact.saved[key])
        assert ms.saved.get(key, 0) <= weight_cast, (key, ms.saved.get(key))


@pytest.mark.slow
def test_the_two_rewrites_savings_add_on_llama():
    """The cause given for Table 3's combined rows: ReSiLU2 and MS-RMSNorm remove disjoint saved tensors, so in a
    saved-tensor account the saving of both is the sum of each one's (within 1 %), unlike the paper's rows."""
    rows = {r.use: r for r in M.reproduce([_without_lora_dropout(_group("Approx-BP Table 3", "LLaMA-7B"))])}
    saved = {u: rows["exact"].ours - rows[u].ours for u in ("relu-sum-k2", "ms-norm", "relu-sum-k2+ms-norm")}
    both = saved["relu-sum-k2"] + saved["ms-norm"]
    assert abs(saved["relu-sum-k2+ms-norm"] - both) < 0.01 * both, saved
    paper = {r.use: r.paper for r in rows.values()}
    assert paper["exact"] - paper["relu-sum-k2+ms-norm"] > 1.5 + (2 * paper["exact"] - paper["relu-sum-k2"]
                                                                  - paper["ms-norm"])


def test_every_cause_names_a_test_that_exists():
    """An explained row points to the test that measures its cause (never a sentence alone)."""
    import ast

    root = Path(__file__).parents[3]
    for cause in set(M.EXPLAINED.values()):
        path, _, name = cause.measured_by.partition("::")
        tree = ast.parse((root / path).read_text())
        assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, cause.measured_by


def test_roberta_on_the_authors_set_up_is_within_with_a_gpus_dropout_masks():
    """Table 4 on the authors' set-up: every rewrite saves what the paper's does (within 2 MiB), and with dropout's
    masks counted as CUDA keeps them (1 byte, not the CPU's 4) every row is within the targets; the CPU's masks had
    put the exact step 860 MiB above the paper's and two rows outside."""
    rows = {r.use: r for r in M.reproduce([_group("Approx-BP Table 4", "RoBERTa-base")])}
    exact = rows["exact"]
    assert all(r.status == "within" for r in rows.values()), M.text(list(rows.values()))
    assert -500 < exact.ours - exact.paper < -300
    for r in rows.values():
        assert abs((exact.ours - r.ours) - (exact.paper - r.paper)) < 2, (r.use, exact.ours - r.ours)


def test_a_change_in_percent_prints_its_unit_once():
    """InvAct's rows printed "−22.9 % %" on the docs page."""
    group = _group("InvAct App. A.1", "ViT-B")
    row = M.Row(group, "invact", -23.8, -23.7, None, None, 1.0)
    table = M.markdown([row])
    assert "| -23.8 % | -23.7 % | within |" in table and "% %" not in table


@pytest.mark.slow
def test_table_11_is_one_sample_from_the_papers_change():
    """The cause given for Table 11's patched row: the largest batches are 26 (exact) and 32 (patched), the step at
    32 fits 12 GiB and at 33 does not, and one sample less would be within the 3 points."""
    group = _group("Approx-BP Table 11", "BERT-base")
    exact, patched = M.reproduce([group])
    assert (exact.ours, patched.ours) == (26, 32) and patched.status == "explained", M.text([exact, patched])
    assert abs(100 * (31 / 26 - 1) - patched.paper_change) < M.POINTS < abs(patched.our_change - patched.paper_change)
    args = parse(shlex.split(M.command(group, "relu-sum-k2+ms-norm"))[2:])
    peak = {b: P.evaluate(Request.from_args(args).at(batch=b), use=args.use).after.peak for b in (32, 33)}
    assert peak[32] <= SM.parse_size(args.budget) < peak[33]
