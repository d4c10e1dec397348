"""The explorers' figures say whose table each curve draws (the package's, the paper's, or the user's file), and
the ReLU-sum figure has its error panel h̃′ − h′."""

from approxbp.approximations import tables as table_files
from approxbp.fitting.plots import plot_invact, plot_relu_sum


def _labels(fig):
    return [label for ax in fig.axes for label in ax.get_legend_handles_labels()[1]]


def test_the_invact_legends_name_the_package_the_paper_and_your_file(tmp_path):
    mine = tmp_path / "mine.json"
    table_files.save(table_files.load("invact/gelu-fast"), mine)
    labels = _labels(plot_invact("gelu", tables=[str(mine)]))
    assert any(label.startswith("ours, packaged: newton") for label in labels), labels
    assert any(label.startswith("paper") for label in labels), labels
    assert any(label.startswith("yours (mine.json): fast") for label in labels), labels
    monotone = _labels(plot_invact("softplus"))
    assert any(label.startswith("ours, packaged: exact") for label in monotone), monotone


def test_the_relu_sum_figure_draws_its_error_panel_and_says_whose():
    ours, paper = table_files.load("relu_sum/gelu-k2-primitive"), table_files.load("relu_sum/gelu-k2-primitive-paper")
    fig = plot_relu_sum(ours, paper)
    labels = _labels(fig)
    assert len(fig.axes) == 3 and "backward error" in fig.axes[2].get_ylabel()
    assert any("ours" in label for label in labels) and any("paper" in label for label in labels), labels
