"""Long jobs talk: in a log (no terminal) a progress line says how far it got and about how long is left,
counted in work done, not guessed from the clock alone; the atlas counts its tables."""

import pytest
from approxbp.fitting import atlas
from approxbp.fitting.progress import progress


def test_a_log_line_says_the_count_and_the_time_left(capsys, monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    bar = progress(total=4, desc="tables", every=0.0)
    bar.update()
    bar.update()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("tables: 2/4 (") and "s left)" in lines[-1]
    bar.update(2)
    assert "left" not in capsys.readouterr().err  # done: no time left to state


def test_the_atlas_counts_one_step_per_table():
    assert atlas.STEPS == 17  # ReLU-sum k = 1…8 × 2 objectives + the InvAct fast form


@pytest.mark.slow
def test_the_atlas_advances_its_bar_by_each_tables_work(monkeypatch):
    """One step per table, each its share of the work (a ReLU-sum fit at k: k², so a k = 8 fit is not counted as a
    k = 1 fit and the time left holds), summing to the bar's total; --bits 1-4 counts only those tables."""
    for bits in (atlas.BITS, range(1, 5)):
        steps = []
        bar = type("Bar", (), {"update": lambda self, k=1, into=steps: into.append(k)})()
        atlas.atlas("gelu", None, bar, bits)  # packaged tables: nothing is fitted
        assert len(steps) == 2 * len(bits) + 1 and sum(steps) == atlas.work(bits)
        assert max(steps[:-1]) == max(bits) ** 2


def test_atlas_bits_are_a_range_and_refused_otherwise(tmp_path, monkeypatch):
    from approxbp.approximations.activations import named_activation

    from approxbp.commands.atlas import _bits

    assert _bits(None, [named_activation("gelu")]) == range(1, 9)  # packaged up to k = 8
    assert _bits(None, [named_activation("x*tanh(exp(x))", "tanhexp")]) == range(1, 5)  # fitted here
    assert _bits("2-3", []) == range(2, 4) and _bits("5", []) == range(5, 6)
    for bad in ("0-3", "4-2", "1-9", "two"):
        try:
            _bits(bad, [])
        except ValueError as err:
            assert "--bits" in str(err) and "1 ≤ K1 ≤ K2 ≤ 8" in str(err)
        else:
            raise AssertionError(bad)


def test_a_heartbeat_speaks_at_most_once_per_period():
    from approxbp.fitting.progress import heartbeat

    said = []
    tick = heartbeat(said.append, "search", every=0.0)
    tick(lambda: "3 boxes")
    assert said and said[0].startswith("search: 3 boxes (")
    quiet = heartbeat(said.append, "search", every=3600.0)
    quiet("never")
    assert len(said) == 1 and heartbeat(None, "x")("y") is None


def test_a_long_certificate_tells_the_log(monkeypatch):
    """A branch and bound with progress on says how far it got while it searches (every 0 s here)."""
    from approxbp.fitting import certify as C
    from approxbp.fitting import progress as P

    said = []
    monkeypatch.setattr(C, "heartbeat", lambda say, what, every=10.0: P.heartbeat(say, what, 0.0))
    from approxbp.approximations import tables as table_files

    C.certify_invact_branch(table_files.load("invact/gelu-fast"), "right", budget_s=600, max_boxes=50, say=said.append)
    assert any("boxes, bound" in s for s in said)
