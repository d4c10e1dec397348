import json

from approxbp.cli import main


def test_fit_writes_a_valid_table(tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = main(["fit", "relu-sum", "--activation", "quick_gelu", "--bits", "2", "--restarts", "2", "--workers", "1",
               "--seed", "3", "--no-progress", "--out", str(out)])
    assert rc == 0
    t = json.loads(out.read_text())
    assert t["activation"] == "quick_gelu" and t["bits"] == 2 and t["provenance"]["seed"] == 3
    assert "--seed 3" in t["provenance"]["command"]
    assert "certificate" in capsys.readouterr().out


def test_bad_input_exits_2_with_message(capsys):
    assert main(["fit", "relu-sum", "--activation", "tanh", "--bits", "2", "--no-progress"]) == 2
    assert "cannot be approximated by a sum of ReLUs" in capsys.readouterr().err


def test_tables_lists_and_validates(capsys):
    assert main(["tables", "--family", "relu-sum"]) == 0
    assert "all valid" in capsys.readouterr().out
