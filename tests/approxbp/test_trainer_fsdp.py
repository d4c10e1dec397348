"""The callback inside an accelerate-launched FSDP2 run: Hugging Face ``Trainer`` with ``fsdp_config={"version":
2}`` on two gloo processes (``torch.distributed.run``), the callback patching the model accelerate sharded on its
first batch (norms merged, gated MLPs fused, a block recomputed, the loss chunked): the losses are stock's and the
saved model loads into the stock class with stock's trained outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import python_path
from _patched_gpt import has_fsdp2

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORKER = Path(__file__).parents[1] / "support" / "_fsdp_trainer.py"


def _run(out: Path, *which: str) -> list[dict]:
    for attempt in range(2):  # gloo's rendezvous on a loaded 2-core machine has aborted (SIGABRT) once in ~10 runs
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                            "--standalone", str(WORKER), str(out), *which], capture_output=True, text=True,
                           timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1",
                                             "PYTHONPATH": python_path(WORKER.parent)})  # it imports _tiny_llm
        if r.returncode == 0 or attempt:
            break
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads((out / f"{w}.json").read_text()) for w in which]


@pytest.mark.slow
def test_the_callback_in_an_accelerate_fsdp2_run_trains_as_stock(tmp_path):
    if not has_fsdp2():
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    stock, ours = _run(tmp_path, "stock", "ours")
    assert ours["norms"] == 5 and "fused 2 gated MLPs" in ours["report"] and ours["chunked"], ours
    assert len(ours["losses"]) == len(stock["losses"]) == 10
    for a, b in zip(stock["losses"], ours["losses"]):
        assert b == pytest.approx(a, rel=1e-6, abs=0), (stock, ours)
    ids = torch.arange(12)[None] % 64
    outputs = []
    for which in ("stock", "ours"):
        loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / which / "final")).eval()
        assert type(loaded.model.norm).__name__ == "LlamaRMSNorm"
        with torch.no_grad():
            outputs.append(loaded(input_ids=ids).logits)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-6, atol=1e-6)
