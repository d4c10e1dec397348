"""What a patched model saves under torch.compile that the stock one does not: the saved tensors of one compiled
training forward of each (inductor's partitioner without code generation, as the coverage benchmark's "saving
compiled"), counted once per storage, parameters excluded, and their difference as (shape, dtype, bytes) multisets.

    python benchmarks/compiled_saved_diff.py bart dory pvt
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_coverage as mc  # noqa: E402


def saved_tensors(model, batch: dict, labels: dict) -> Counter:
    """(shape, dtype, bytes) of each storage saved for backward by one compiled training forward."""
    torch._dynamo.reset()
    run = torch.compile(model.train(), backend="aot_eager_decomp_partition")
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params and s._cdata not in seen:
            seen[s._cdata] = ((tuple(t.shape), str(t.dtype).removeprefix("torch."), s.nbytes()), s)
        return t

    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mc._loss(run, batch, labels)
    return Counter(key for key, _ in seen.values())


def main() -> int:
    import transformers
    from approxbp.kernels import patch_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+", help="model types of the coverage benchmark")
    args = p.parse_args()
    known = {t: (head, cls) for t, head, cls in mc.model_types()}
    for model_type in args.models:
        head, cls = known[model_type]
        config = mc.tiny_config(model_type)
        batch, labels = mc.example_batch(head, config)
        torch.manual_seed(0)
        stock = getattr(transformers, cls)(config).float()
        ours = copy.deepcopy(stock)
        patch_model(ours, family="invact", example_input=batch)
        got = [saved_tensors(m, batch, labels) for m in (stock, ours)]
        total = [sum(k[2] * n for k, n in c.items()) for c in got]
        print(f"{model_type}: stock {total[0]} B, patched {total[1]} B compiled")
        print("  only stock:", dict(got[0] - got[1]))
        print("  only patched:", dict(got[1] - got[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
