"""Per-block options of the ViT: activation checkpointing (full, selective,
every n-th block) gives the loss and gradients of the plain network, with
drop path on, for DINO's and DINOv2's ViTs; selective checkpointing keeps
the matrix products and recomputes the rest; torch.compile of each block
matches eager, also sharded by FSDP over 2 processes; the config's keys
reach the models."""

from collections import Counter
from pathlib import Path

import pytest
import torch
from dino_opt.config import load_config
from dino_opt.models import (
    CHECKPOINT_POLICIES,
    VisionTransformer,
    apply_block_options,
    recompute_flops_per_byte,
)
from dino_opt.models import layers as layers_module
from dino_opt.models.layers import Block
from dino_opt.observe import AllocationTrace
from dino_opt.train import build_models
from gloo_ranks import run_ranks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).parent
SETTINGS = [("full", 1), ("selective", 1), ("full", 2), ("selective", 3)]


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these are small tensors, and on a busy 2-core
    machine OpenMP's spinning threads only slow them down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dino_vit(drop_path_rate: float = 0.3):
    return VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=4, drop_path_rate=drop_path_rate
    )


def dinov2_vit():
    """Registers, LayerScale, SwiGLU, uniform drop path, a mask token."""
    return VisionTransformer(
        img_size=28,
        patch_size=7,
        embed_dim=48,
        depth=4,
        num_heads=4,
        drop_path_rate=0.3,
        drop_path_uniform=True,
        ffn_layer="swiglufused",
        layerscale_init=0.5,
        num_register_tokens=4,
        use_mask_token=True,
    )


def _randomize(model: nn.Module, seed: int = 3) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)
    return model


def _loss_and_grads(model, kind: str, seed: int = 1):
    gen = torch.Generator().manual_seed(0)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the drop-path masks
    if kind == "dino":
        x = torch.randn(6, 3, 32, 32, generator=gen, dtype=torch.float64)
        loss = model(x).sin().sum()
    else:
        x = torch.randn(6, 3, 28, 28, generator=gen, dtype=torch.float64)
        masks = torch.rand(6, 16, generator=gen) < 0.4
        out = model.forward_features(x, masks)
        loss = out["x_norm_clstoken"].sin().sum() + out["x_norm_patchtokens"].cos().sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["dino", "dinov2"])
@pytest.mark.parametrize("policy, every", SETTINGS)
def test_checkpointing_gives_the_same_loss_and_gradients(kind, policy, every):
    model = _randomize(dino_vit() if kind == "dino" else dinov2_vit()).double().train()
    ref_loss, ref = _loss_and_grads(model, kind)
    assert model.set_activation_checkpointing(policy, every) is model
    expected = [policy if i % every == 0 else "none" for i in range(4)]
    assert [b.checkpointing for b in model.blocks] == expected
    loss, got = _loss_and_grads(model, kind)
    # drop path drew the same masks in the recomputation (the RNG state was restored)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert got.keys() == ref.keys()
    for name, g in got.items():
        torch.testing.assert_close(g, ref[name], rtol=1e-10, atol=1e-12, msg=name)
    # another seed draws other masks: the test can tell
    other, _ = _loss_and_grads(model, kind, seed=2)
    assert not torch.allclose(other, ref_loss)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _ops(policy: str, threshold: float = 0.0) -> Counter:
    model = _randomize(dino_vit(drop_path_rate=0.0)).train()
    model.set_activation_checkpointing(policy, 1, threshold)
    x = torch.randn(4, 3, 32, 32)
    with _OpCounter() as counter:
        model(x).sum().backward()
    return counter.ops


def test_selective_keeps_the_matrix_products_and_recomputes_the_rest():
    none, full, selective = _ops("none"), _ops("full"), _ops("selective")
    matmuls = ("mm", "addmm", "bmm")
    attention = "_scaled_dot_product_flash_attention_for_cpu"
    assert sum(selective[op] for op in matmuls) == sum(none[op] for op in matmuls)
    assert selective[attention] == none[attention] == 4  # computed once per block
    assert sum(full[op] for op in matmuls) > sum(none[op] for op in matmuls)
    assert full[attention] == 8  # full checkpointing recomputes attention too
    # norms and GELU are recomputed by both
    for op in ("native_layer_norm", "gelu"):
        assert selective[op] == full[op] > none[op], op


# dino_vit in float32: linear layers of input width 32 cost 2 * 32 / 4 = 16
# FLOPs per byte to recompute, the MLP's fc2 (input 128) 64, attention over
# 17 keys of 8 per head 4 * 17 * 8 / (8 * 4 + 4) = 15.1.
LINEAR, FC2, ATTENTION = 16.0, 64.0, 4 * 17 * 8 / 36


@pytest.mark.parametrize("kind", ["dino", "dinov2"])
@pytest.mark.parametrize("threshold", [1.0, ATTENTION + 0.1, LINEAR + 1])
def test_a_recompute_threshold_gives_the_same_loss_and_gradients(kind, threshold):
    model = _randomize(dino_vit() if kind == "dino" else dinov2_vit()).double().train()
    ref_loss, ref = _loss_and_grads(model, kind)
    model.set_activation_checkpointing("selective", 1, threshold)
    assert all(b.recompute_threshold == threshold for b in model.blocks)
    loss, got = _loss_and_grads(model, kind)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for name, g in got.items():
        torch.testing.assert_close(g, ref[name], rtol=1e-10, atol=1e-12, msg=name)


def test_the_cost_of_recomputing_an_output():
    x = torch.randn(10, 32)
    w1, w2 = torch.randn(32, 128), torch.randn(128, 32)
    assert recompute_flops_per_byte(torch.ops.aten.mm.default, x, w1) == LINEAR
    assert recompute_flops_per_byte(torch.ops.aten.mm.default, x @ w1, w2) == FC2
    bias = torch.zeros(128, dtype=torch.bfloat16)
    x16, w16 = x.bfloat16(), w1.bfloat16()
    assert recompute_flops_per_byte(torch.ops.aten.addmm.default, bias, x16, w16) == 32.0
    q = torch.randn(2, 4, 17, 8)
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert recompute_flops_per_byte(attention, q, q, q) == pytest.approx(ATTENTION)
    assert recompute_flops_per_byte(torch.ops.aten.gelu.default, x) is None


def test_the_threshold_drops_the_cheapest_outputs_first():
    """What a step recomputes, counted: above attention's cost, attention is
    recomputed and the linear layers are not; above theirs, they are too."""
    none = _ops("none")
    counts = {t: _ops("selective", t) for t in (0.0, ATTENTION + 0.1, LINEAR + 1)}
    attention = "_scaled_dot_product_flash_attention_for_cpu"

    def matmuls(ops):
        return ops["mm"] + ops["addmm"]

    assert counts[0.0][attention] == none[attention] == 4
    assert counts[ATTENTION + 0.1][attention] == 8
    assert matmuls(counts[ATTENTION + 0.1]) == matmuls(none) == matmuls(counts[0.0])
    assert matmuls(counts[LINEAR + 1]) > matmuls(counts[ATTENTION + 0.1])


@pytest.mark.parametrize("layerscale", [None, 0.1])
def test_above_zero_an_output_no_backward_reads_is_not_kept(layerscale):
    """The feed-forward network's last output is read by nothing in the
    backward without LayerScale: threshold 0 keeps it (every matrix
    product's output), any threshold above does not."""
    block = Block(32, 4, init_values=layerscale).train()
    block.checkpointing = "selective"
    x = torch.randn(64, 17, 32, requires_grad=True)

    def kept(threshold: float) -> int:
        block.recompute_threshold = threshold
        with AllocationTrace() as trace:
            out = block(x)
        del out
        return trace.live()[-1][1]

    fc2_output = 64 * 17 * 32 * 4
    assert kept(0.0) - kept(1.0) == (0 if layerscale else fc2_output)


def test_checkpointing_only_while_training_with_autograd(monkeypatch):
    calls = []
    real = layers_module.checkpoint

    def counting(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real(*args, **kwargs)

    monkeypatch.setattr(layers_module, "checkpoint", counting)
    model = dino_vit().set_activation_checkpointing("selective", 2)
    x = torch.randn(2, 3, 32, 32)
    model(x)
    assert calls == [False, False]  # blocks 0 and 2, non-reentrant
    calls.clear()
    with torch.no_grad():
        model(x)
    model.eval()(x)
    assert calls == []
    assert model.grad_checkpointing and not model.set_grad_checkpointing(False).grad_checkpointing


def test_bad_options_are_refused():
    model = dino_vit()
    with pytest.raises(ValueError, match="one of none, full, selective"):
        model.set_activation_checkpointing("partial")
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        model.set_activation_checkpointing("full", 0)
    with pytest.raises(ValueError, match="recompute_threshold must be >= 0, got -1"):
        model.set_activation_checkpointing("selective", 1, -1)
    with pytest.raises(ValueError, match="needs a ViT backbone, got Sequential"):
        apply_block_options(nn.Sequential(nn.Linear(2, 2)), "full")
    assert CHECKPOINT_POLICIES == ("none", "full", "selective")


def test_the_config_reaches_both_models():
    options = [
        "hardware.activation_checkpointing=selective",
        "hardware.checkpoint_every=4",
        "hardware.compile=true",
    ]
    cfg = load_config(None, ["model.backbone=vit_tiny", *options])
    student, teacher = build_models(cfg)
    policies = [b.checkpointing for b in student.backbone.blocks]
    assert policies == ["selective", "none", "none", "none"] * 3
    assert all(b.checkpointing == "none" for b in teacher.backbone.blocks)  # no backward
    for net in (student, teacher):  # compiled in place, block by block, and the head
        assert all(b._compiled_call_impl is not None for b in net.backbone.blocks)
        assert net.backbone._compiled_call_impl is None and net.head._compiled_call_impl is not None
    assert student.state_dict().keys() == teacher.state_dict().keys()
    assert not any("_orig_mod" in k for k in student.state_dict())
    plain, _ = build_models(load_config(None, ["model.backbone=vit_tiny"]))
    assert student.state_dict().keys() == plain.state_dict().keys()
    assert all(b._compiled_call_impl is None for b in plain.backbone.blocks)


def test_compiled_checkpointed_blocks_match_eager():
    """torch.compile (inductor, on this CPU) of each block with selective
    checkpointing inside, against the plain eager network. The drop-path
    masks come from eager's generator (inductor's fallback_random), so the
    two draw the same ones."""
    torch.manual_seed(0)
    eager = VisionTransformer(
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=2,
        drop_path_rate=0.2,
        drop_path_uniform=True,
    ).train()
    compiled = VisionTransformer(
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=2,
        drop_path_rate=0.2,
        drop_path_uniform=True,
    ).train()
    compiled.load_state_dict(eager.state_dict())
    apply_block_options(compiled, "selective", compile=True)
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch._inductor.config.patch(fallback_random=True):
        results = []
        for model in (eager, compiled):
            torch.manual_seed(5)
            loss = model(x).sin().sum()
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref), (loss, got) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name, g in got.items():
        torch.testing.assert_close(g, ref[name], rtol=1e-3, atol=1e-4, msg=name)


def test_compiled_checkpointed_blocks_compose_with_fsdp(tmp_path):
    """2 gloo processes (dist_compile_worker.py): the student's blocks
    checkpointed and compiled by build_models, then sharded by fully_shard;
    two steps give the losses of the same run in eager mode."""
    for result in run_ranks(HERE / "workers" / "dist_compile_worker.py", tmp_path):
        assert result["compiled_blocks"] == 12
        assert result["compiled"] == pytest.approx(result["eager"], rel=1e-5)
