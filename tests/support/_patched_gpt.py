"""A small GPT-style model with every drop-in patched in, and the worker of the DDP/FSDP2 test: a module of its own,
so that a spawned process imports it by name (pytest's importlib mode gives test files no importable name)."""

import contextlib
import os
import socket

import torch
from approxbp.kernels import patch_model
from torch import nn

from approxbp.blocks import GPTBlock


def _gpt(n_blocks=2, d=32, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(*[GPTBlock(d=d, hidden=4 * d, heads=4) for _ in range(n_blocks)], nn.LayerNorm(d),
                          nn.Linear(d, 11))
    with torch.no_grad():  # norms away from their init values, so that a wrong merge would show
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1.0, 0.2)
                m.bias.normal_(0.0, 0.2)
    return model


def _patched(activation="relu-sum", use_triton=False, **kw):
    model = _gpt(**kw)
    report = patch_model(model, family=activation)
    assert len(report.norms) == 2 * len([m for m in model if isinstance(m, GPTBlock)]) + 1, report
    for m in model.modules():
        if hasattr(m, "use_triton"):
            m.use_triton = use_triton
    return model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(target, *args) -> list[int | None]:
    """``target(rank, 2, port, *args)`` in two spawned processes (gloo ranks); their exit codes. gloo's rendezvous
    on a loaded 2-core machine has aborted (SIGABRT) once in ~10 runs: a killed worker is retried once, a Python
    error in a worker (exit code 1) never."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    for attempt in range(2):
        port = _free_port()
        procs = [ctx.Process(target=target, args=(r, 2, port, *args)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        codes = [p.exitcode for p in procs]
        if not (attempt == 0 and any(c is not None and c < 0 for c in codes)):
            break
    return codes


def has_fsdp2() -> bool:
    """Whether this torch has FSDP2 (``torch.distributed.fsdp.fully_shard``)."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int):
    """A spawned rank's gloo process group (rendezvous on localhost:port), destroyed on the way out."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp_worker(rank, world, port, x, out_dir, cases):
    """Each case (name, fsdp, patch_after) one after the other in one process group (one spawn of the two ranks for
    all of them): rank 0 saves the case's full gradients to ``out_dir/name.pt``."""
    with gloo_group(rank, world, port):
        for name, fsdp, patch_after in cases:
            grads = _distributed_grads(rank, world, x, fsdp, patch_after)
            if rank == 0:
                torch.save(grads, os.path.join(out_dir, f"{name}.pt"))


def _distributed_grads(rank, world, x, fsdp, patch_after):
    """The full gradients of one step of the patched GPT under DDP or FSDP2 (patched before or after wrapping)."""
    model = _gpt() if patch_after else _patched("relu-sum")
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for m in model:
            if isinstance(m, GPTBlock):
                fully_shard(m)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    shard = x.chunk(world)[rank]
    if patch_after:  # the wrapped model patched in place (DDP: its .module), as a trainer's callback does;
        # FSDP2 with the example batch (tracing a sharded model would run FSDP2's hooks: consumers found by a run)
        report = patch_model(getattr(model, "module", model), family="relu-sum",
                             example_input=shard if fsdp else None)
        assert len(report.norms) == 5, report  # every norm merged, as in the single-process reference
    model(shard).square().mean().backward()
    grads = []
    for p in model.parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads.append(g.detach().clone())
    return grads
