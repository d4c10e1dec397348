"""Norms whose output also feeds ops that keep nothing for backward: post-LN encoders' residual
add. The norm becomes a shared-output MS-norm: it returns y = α⊙z + β (the stock value) with z attached, its Linear
consumers read and save z, and the add reads y; the model trains exactly as the stock one and saves less."""

import copy

import numpy as np
import pytest
import torch
from approxbp.kernels import patch_model, unpatch
from approxbp.kernels.rewrite.norm_merge import MSLayerNormSharedOutput, NormInputLinear, attached_z
from torch import nn


class PostLN(nn.Module):
    """BERT's layer in small: h = LN₁(x + attn-ish(x)); out = LN₂(h + W₂ gelu(W₁ h)). LN₁'s output feeds W₁ and the
    residual add; LN₂'s output is the block's output."""

    def __init__(self, d=16):
        super().__init__()
        self.mix, self.ln1, self.up, self.act = nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU()
        self.down, self.ln2 = nn.Linear(4 * d, d), nn.LayerNorm(d)

    def forward(self, x):
        h = self.ln1(x + self.mix(x))
        return self.ln2(h + self.down(self.act(self.up(h))))


def _model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(PostLN(), PostLN(), nn.Linear(16, 3)).double()
    with torch.no_grad():  # affines away from their init, so that a wrong α or β would show
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1.0, 0.3)
                m.bias.normal_(0.0, 0.3)
    return model


def _step(model, x):
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.square().sum().backward()
    return y.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("example", [True, False], ids=["dispatch", "fx"])
def test_post_ln_norms_share_their_output_and_train_exactly(example):
    stock = _model()
    ours = copy.deepcopy(stock)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    report = patch_model(ours, family=None, example_input=x if example else None)
    assert len(report.norms) == 4 and not report.skipped, report
    assert sum(isinstance(m, MSLayerNormSharedOutput) for m in ours.modules()) == 4  # every norm returns y as stock
    assert "add read its output as stock" in report.norms[0]
    (y0, g0), (y1, g1) = _step(stock, x), _step(ours, x)
    assert torch.allclose(y0, y1, rtol=1e-12, atol=1e-12)
    assert g0.keys() == g1.keys() and all(torch.allclose(g0[k], g1[k], rtol=1e-9, atol=1e-12) for k in g0)
    if example:
        before, after = report.saved_bytes
        assert after < 0.85 * before, report.saved_bytes


def test_the_consumer_reads_z_and_falls_back_to_y_when_y_changed():
    model = _model()
    patch_model(model, family=None, example_input=torch.randn(2, 16, dtype=torch.float64))
    ln, up = model[0].ln1, model[0].up
    assert isinstance(up, NormInputLinear)
    x = torch.randn(2, 16, dtype=torch.float64)
    y = ln(x)
    z = attached_z(y, ln)
    assert z is not None and not torch.equal(z, y)
    want = up(y)
    y.mul_(1.0)  # an in-place op on y: its version moves on, z no longer stands for it
    assert attached_z(y, ln) is None and torch.allclose(up(y), want, rtol=1e-12)


def test_shared_output_norms_compile_and_unpatch():
    stock = _model()
    ours = copy.deepcopy(stock)
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    patch_model(ours, family=None, example_input=x)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    (y0, g0), (y1, g1) = _step(stock, x), _step(compiled, x)
    assert torch.allclose(y0, y1, rtol=1e-10) and all(torch.allclose(g0[k], g1[k], rtol=1e-8, atol=1e-12)
                                                      for k in g0)
    unpatch(ours)
    assert sum(isinstance(m, nn.LayerNorm) for m in ours.modules()) == 4
    with torch.no_grad():
        assert torch.allclose(ours(x), stock(x), rtol=1e-12)


def test_hf_bert_gets_ms_ln_on_its_post_ln_norms():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg)
    report = patch_model(model, family="invact", example_input={"input_ids": torch.randint(3, 128, (2, 12))})
    shared = [n for n in report.norms if "SharedOutput" in n]
    assert len(shared) == 6, report  # both LayerNorms of both layers, the embeddings' (read through dropout: as
    assert shared[0].startswith("bert.embeddings.LayerNorm")  # stock) and the LM head's transform
    before, after = report.saved_bytes
    assert 1 - after / before > 0.18, report.saved_bytes  # measured 20.7 % (11.2 % without shared outputs)


def test_a_consumer_handed_another_norms_output_reads_it_as_stock():
    """Layer drop (wav2vec2) skips a block at random in training: a consumer of one shared-output norm can then get
    another norm's y. The attached z names its norm, so the consumer reads that y as the stock Linear would."""
    model = _model()
    patch_model(model, family=None, example_input=torch.randn(2, 16, dtype=torch.float64))
    first, consumer_of_second = model[0].ln1, model[1].up  # 1.up's norm is 1.ln1
    x = torch.randn(2, 16, dtype=torch.float64)
    y = first(x)
    assert attached_z(y, first) is not None and attached_z(y, model[1].ln1) is None
    want = torch.nn.functional.linear(y, consumer_of_second.weight, consumer_of_second.bias)
    assert torch.allclose(consumer_of_second(y), want, rtol=1e-12)


def test_a_norm_read_across_blocks_that_training_may_skip_trains_as_stock():
    """wav2vec2's layer drop skips a block when training and ``torch.rand([]) < p``, so the final norm's readers
    differ from step to step (before the shared-output norm, a consumer read another norm's z when a block was
    dropped, 4e-4 off after 10 steps, and such a norm was left alone). Rewritten now, the patched model trains
    exactly as stock, draws included: a consumer handed anything but its norm's own output computes as stock."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                      conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, layerdrop=0.5,
                                      mask_time_length=2, num_labels=2)
    torch.manual_seed(0)
    stock = transformers.Wav2Vec2ForSequenceClassification(cfg).double()
    ours = copy.deepcopy(stock)
    x = {"input_values": torch.randn(2, 4000, dtype=torch.float64)}
    report = patch_model(ours, family=None, example_input=x)
    assert any("final_layer_norm" in s for s in report.norms), report  # read across the skippable blocks
    losses = []
    for model in (stock, ours):
        torch.manual_seed(0)  # layer drop
        np.random.seed(0)  # time masks
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = []
        for _ in range(4):
            opt.zero_grad()
            loss = model(**x, labels=torch.tensor([0, 1])).loss
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(torch.tensor(run, dtype=torch.float64))
    assert torch.allclose(losses[0], losses[1], rtol=1e-9), losses


class HFRMSNorm(nn.Module):
    """Hugging Face's RMSNorm as GLM-4/OLMo-2/Qwen3 write it (fp32 input, pow, mean, rsqrt, two products): it keeps
    its input, the normalised product and σ⁻¹ for backward."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(1 + 0.3 * torch.randn(d)), eps

    def forward(self, x):
        h = x.to(torch.float32) if x.dtype != torch.float64 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class PostNormBlock(nn.Module):
    """GLM-4's sub-layer: h = x + post(mix(pre(x))); the post-norm is read only by the residual add. And a QK-norm read
    only by a rotation (Qwen3's RoPE: mul by a constant, neg, cat), then by a product with a trained tensor."""

    def __init__(self, d=16):
        super().__init__()
        self.pre, self.mix, self.post, self.qk = HFRMSNorm(d), nn.Linear(d, d), HFRMSNorm(d), HFRMSNorm(d)
        self.key = nn.Parameter(torch.randn(d))

    def forward(self, x):
        h = x + self.post(self.mix(self.pre(x)))
        q = self.qk(h)
        half = q.shape[-1] // 2
        rotated = q * 0.6 + torch.cat([-q[..., half:], q[..., :half]], -1) * 0.8
        return h + rotated * self.key


class WritesIntoIt(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm, self.mix = HFRMSNorm(d), nn.Linear(d, d)

    def forward(self, x):
        y = self.norm(self.mix(x))
        y.add_(1.0)
        return x + y


@pytest.mark.parametrize("example", [True, False], ids=["dispatch", "fx"])
def test_norms_read_only_by_ops_save_their_output_in_place_of_their_input(example):
    """A norm no Linear reads (GLM-4's post-norms, Qwen3's QK-norms) saves z and σ⁻¹ in place of its input and
    returns α⊙z + β, and the model trains exactly as stock."""
    torch.manual_seed(0)
    stock = nn.Sequential(PostNormBlock(), PostNormBlock()).double()
    ours = copy.deepcopy(stock)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    report = patch_model(ours, family=None, example_input=x if example else None)
    alone = [n for n in report.norms if "in place of its input" in n and "save z" not in n]
    assert {n.split()[0] for n in alone} == {f"{i}.{m}" for i in (0, 1) for m in ("post", "qk")}, report
    assert "add" in next(n for n in alone if n.startswith("0.post")), report
    (y0, g0), (y1, g1) = _step(stock, x), _step(ours, x)
    assert torch.allclose(y0, y1, rtol=1e-12, atol=1e-12)
    assert all(torch.allclose(g0[k], g1[k], rtol=1e-9, atol=1e-12) for k in g0)
    if example:
        before, after = report.saved_bytes
        assert after < before, report.saved_bytes


def test_a_norm_whose_output_is_written_in_place_trains_as_stock():
    """The norm returns the stock y (z is its own saved tensor), so a reader writing into y changes nothing that
    the backward needs: the model computes and trains as stock, and still saves less."""
    torch.manual_seed(0)
    stock = WritesIntoIt().double()
    model = copy.deepcopy(stock)
    x = torch.randn(2, 16, dtype=torch.float64)
    report = patch_model(model, family=None, example_input=x)
    assert report.norms and "add_" in report.norms[0], report
    (y0, g0), (y1, g1) = _step(stock, x), _step(model, x)
    assert torch.allclose(y0, y1, rtol=1e-12, atol=1e-12)
    assert all(torch.allclose(g0[k], g1[k], rtol=1e-9, atol=1e-12) for k in g0)


def test_a_consumer_of_a_view_of_y_reads_the_same_view_of_z():
    """A classifier reading the first token (y[:, 0]) read y itself and kept all of y alive (ViT's saving fell 3
    points when its last norm returned the stock value); it now takes the same view of z, exactly."""
    model = _model()
    patch_model(model, family=None, example_input=torch.randn(2, 16, dtype=torch.float64))
    ln, up = model[0].ln1, model[0].up
    x = torch.randn(3, 4, 16, dtype=torch.float64, requires_grad=True)
    y = ln(x)
    view = y[:, 0]
    z = attached_z(view, ln)
    assert z is not None and z.untyped_storage()._cdata == attached_z(y, ln).untyped_storage()._cdata
    ref = copy.deepcopy(_model())[0]
    want = ref.up(ref.ln1(x)[:, 0])
    got = up(view)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    gx, = torch.autograd.grad(got.square().sum(), x)
    rx, = torch.autograd.grad(want.square().sum(), x)
    torch.testing.assert_close(gx, rx, rtol=1e-10, atol=1e-12)


class MasksTheConsumersOutput(nn.Module):
    """data2vec-audio's pattern: a consumer Linear's (3-D, with bias) output is written in place (hidden[mask] = 0)."""

    def __init__(self, d=16):
        super().__init__()
        self.ln, self.up, self.head = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, 2)

    def forward(self, x):
        h = self.up(self.ln(x))
        h[:, 0] = 0.0
        return self.head(torch.tanh(h) + x)


def test_a_consumers_output_written_in_place_trains_as_stock_without_a_copy():
    """F.linear with a bias returns a view of its 2-D product, which autograd forbids writing in place when a custom
    Function returns it; the consumer hands back the same storage as a plain tensor (no copy of every consumer
    output, which the H100 profile of the ViT step found) and the in-place write trains as stock."""
    from approxbp.kernels.ops.norm_linear import _not_a_view

    torch.manual_seed(0)
    stock = MasksTheConsumersOutput().double()
    model = copy.deepcopy(stock)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    report = patch_model(model, family=None, example_input=x)
    assert isinstance(model.up, NormInputLinear) and not report.skipped, report
    (y0, g0), (y1, g1) = _step(stock, x), _step(model, x)
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)
    assert all(torch.allclose(g0[k], g1[k], rtol=1e-9, atol=1e-12) for k in g0)
    out = nn.functional.linear(x, model.up.weight, model.up.bias)
    assert out._base is not None  # the case at hand: F.linear's own view
    plain = _not_a_view(out)
    assert plain._base is None and plain.data_ptr() == out.data_ptr()


def test_z_is_handed_off_in_the_open_and_held_no_longer_than_y():
    """The shared-output norm hands z to its consumers through its ZHandoff (vars(norm), not an attribute on the
    tensor y): the entry goes with y, and a deep copy of the norm starts with none."""
    import gc

    from approxbp.kernels.rewrite import swaps
    from approxbp.kernels.rewrite.norm_merge import ZHandoff

    model = _model()
    patch_model(model, family=None, example_input=torch.randn(2, 16, dtype=torch.float64))
    ln = model[0].ln1
    assert isinstance(ln, MSLayerNormSharedOutput)
    y = ln(torch.randn(2, 16, dtype=torch.float64))
    assert not [k for k in dir(y) if "approxbp" in k]  # nothing rides on the tensor
    handoff = vars(ln)[swaps.Z_HANDOFF]
    assert isinstance(handoff, ZHandoff) and attached_z(y, ln) is not None
    assert not copy.deepcopy(ln).__dict__[swaps.Z_HANDOFF]._by_y
    del y
    gc.collect()
    assert not handoff._by_y  # z went with y
