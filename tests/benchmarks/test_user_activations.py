"""benchmarks/user_activations.py: the docs page shows exactly the committed results (no number typed by hand), every
step of every activation ends ok or refused with its reason, and the step runner reads a refusal as one."""

import json
import runpy

from _helpers import ROOT

SCRIPT = runpy.run_path(str(ROOT / "benchmarks" / "user_activations.py"))
RESULTS = json.loads((ROOT / "benchmarks" / "results" / "user_activations.json").read_text())
DOCS = (ROOT / "docs" / "user-activations.md").read_text()


def test_the_docs_table_is_the_committed_results():
    table = DOCS.split("<!-- user-activations:start -->\n")[1].split("<!-- user-activations:end -->")[0]
    assert table == SCRIPT["markdown"](RESULTS["rows"])


def test_every_activation_went_through_or_was_refused_with_a_reason():
    rows = RESULTS["rows"]
    assert set(rows) == set(SCRIPT["ACTIVATIONS"])
    for name, steps in rows.items():
        for s in steps:  # a certificate may stay open within its box budget (rigorous, not as tight as claimed)
            assert s["status"] in ("ok", "refused") or (s["status"], s["step"][:7]) == ("not certified", "certify"), s
            assert s["status"] != "refused" or s["reason"].startswith("approxbp: error:"), (name, s)
        trained = [s for s in steps if s["step"].startswith("patch + train")]
        assert all(s["saved_bytes"][1] < s["saved_bytes"][0] for s in trained), (name, trained)
        assert trained, (name, steps)  # every one trains: Logish and Smish (eq. 13 and InvAct's tail rule refuse
        if name in ("logish", "smish"):  # them) through FewBit's free levels, now ReLU-sum tables with kernels
            assert all(s["step"].endswith("-free)") for s in trained), trained


def test_a_refusal_is_one_line_with_the_reason():
    step = SCRIPT["run"]("fit invact", ["fit", "invact", "--activation", "tanh(x)", "--no-progress"])  # inf = −1
    assert step["status"] == "refused" and step["reason"].startswith("approxbp: error:"), step
