"""The error atlas figure: one colour per family, so a solid line and its dashed twin read apart (issue 47)."""

from approxbp.fitting.atlas import plot_atlas
from matplotlib.colors import to_hex

FAMILIES = ("fewbit-uniform", "fewbit-normal", "relu-sum-primitive", "relu-sum-derivative", "invact-paper",
            "invact-released", "invact-newton", "invact-fast")


def test_every_family_in_the_legend_has_its_own_colour():
    rows = [{"family": f, "bits": b, "l2_normal": 1e-3 / b, "linf": 1e-2 / b}
            for f in FAMILIES for b in ((1, 2, 3) if not f.startswith("invact") else (1,))]
    fig = plot_atlas("gelu", rows)
    handles, labels = fig.axes[1].get_legend_handles_labels()
    assert len(labels) == len(FAMILIES)
    colours = [to_hex(h.get_color()) for h in handles]
    assert len(set(colours)) == len(colours), dict(zip(labels, colours))
    assert [t for t in fig.axes[0].get_xticks()] == list(range(1, 9))  # whole bits only
