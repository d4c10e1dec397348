"""Each training step's peak in a real Trainer run on the CPU: the bytes of every storage alive (parameters,
gradients, optimizer states, activations), counted by a dispatch mode from the step's start to its end (after the
optimizer step). A mode rather than MemTracker's module hooks, because it can start inside a call: on the step whose
first call approxbp patches (the planning runs its own MemTracker), counting starts once the patch is made, before
that call's forward. ``test_trainer_budget.py`` checks it against MemTracker's peak on a stock step."""

import itertools

import torch
import transformers
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of the storages alive: those of ``held`` tensors and of every operation's outputs."""

    def __init__(self, held):
        super().__init__()
        self.live, self.peak = {}, 0
        for t in held:
            self._add(t)
        self._update()

    def _add(self, t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in self.live or self.live[key][0].expired():
                self.live[key] = (StorageWeakRef(storage), storage.nbytes())

    def _update(self):
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._add(t)
        self._update()
        return out


def held(model, optimizer):
    """The tensors a step starts with: the model's parameters, buffers and gradients, the optimizer's states."""
    states = (v for s in (optimizer.state.values() if optimizer else ()) for v in s.values())
    grads = (p.grad for p in model.parameters() if p.grad is not None)
    return [t for t in itertools.chain(model.parameters(), model.buffers(), grads, states)
            if isinstance(t, torch.Tensor)]


class StepPeaks(transformers.TrainerCallback):
    """``peaks[i]``: step i + 1's peak (:class:`LiveBytes`). With ``after`` (an ApproxBPCallback that has not patched
    yet), the step that patches is counted from the patch on."""

    def __init__(self, after=None):
        self.peaks, self.after, self._mode, self.held_too = [], after, None, []  # held_too: alive through each step
        if after is not None:  # before the trainer hands ApproxBPCallback its model
            patch = after._patch

            def then_count(*a, **k):
                patch(*a, **k)
                self._start()

            after._patch = then_count

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._model, self._optimizer = model, optimizer

    def _start(self):
        self._mode = LiveBytes(held(self._model, self._optimizer) + list(self.held_too))
        self._mode.__enter__()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.after is None or self.after.report is not None:
            self._start()

    def on_step_end(self, args, state, control, **kwargs):
        self._mode.__exit__(None, None, None)
        self.peaks.append(self._mode.peak)
        self._mode = None
