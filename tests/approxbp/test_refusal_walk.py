"""No dead ends: from every fit command a user may start with, for activations the package had never seen (a leaky
square, leaky ReLU, x + sin²x, a scaled Mish), every refusal names a command, and every command it names either
succeeds or refuses differently — never the same refusal again (a circle), never a refusal that names nothing."""

import re
import shlex

import pytest

from approxbp.cli import main

ACTIVATIONS = ("select(x, x**2, 0.05*x)", "select(x, x, 0.1*x)", "x + sin(x)**2", "1.5*x*tanh(log(1 + exp(x)))")
STARTS = (["fit", "relu-sum", "--bits", "2"], ["fit", "invact"], ["fit", "invact", "--form", "fast"],
          ["fit", "invact", "--form", "exact"], ["fit", "invact", "--form", "newton"])
#: a command a refusal names: `approxbp fit … --activation '…'` and its --bits, as the messages print it
NAMED = re.compile(r"approxbp (fit [^']*'[^']*'(?: --bits \d+)?)")


def _run(argv, capsys) -> tuple[int, str]:
    code = main([*argv, "--no-progress"])
    return code, capsys.readouterr().err.strip()


@pytest.mark.slow
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_refusal_leads_somewhere_new(activation, capsys):
    succeeded = 0
    for start in STARTS:
        paths = [([*start, "--activation", activation], ())]
        while paths:
            argv, seen = paths.pop()
            code, err = _run(argv, capsys)
            if code == 0:
                succeeded += 1
                continue
            message = err.splitlines()[-1]
            assert message not in seen, f"a circle: {shlex.join(argv)} refuses as before: {message}"
            named = NAMED.findall(message)
            assert named, f"a dead end: {shlex.join(argv)}: {message}"
            assert len(seen) < 4, f"a chain of {len(seen) + 1} refusals from {start}: {message}"
            paths += [(shlex.split(command), (*seen, message)) for command in named]
    assert succeeded, f"no command reaches a table for {activation}"
