"""Any student: a timm model by name, a torchvision model or a function's
module (tests_py/own_nets.py) as a distillation student, read as a feature
map or as tokens; each student started from its own weights; each exported
for the library it came from; what cannot be a student refused in one line
before any training."""

import contextlib
import io
import json

import own_nets
import pytest
import timm
import torch
import torchvision
from dino_opt.cli import main
from dino_opt.config import ConfigError, apply_overrides, default_config, load_config
from dino_opt.models import ExternalBackbone, backbone_tokens, build_backbone
from dino_opt.models.external import unreached_parameters
from dino_opt.models.vit import resize_pos_embed
from dino_opt.train import build_models
from dino_opt.weights import start_students
from dino_opt.weights.export.cnn import export_cnn
from dino_opt.weights.load.reading import TRAINING_KEY, training_sidecar
from tiny import TINY, final_state
from torch import nn

OWN = "own_nets:small_cnn"
STUDENTS = [
    *TINY,
    "recipe.name=distill",
    "model.drop_path_rate=0",
    "data.batch_size=4",
    "schedule.epochs=1",
    "schedule.warmup_epochs=0",
    "logging.tensorboard=false",
    "logging.profile=false",
    f"recipe.distill.students=[timm:resnet18,{OWN}]",
]


def test_a_torchvision_resnet_is_read_as_the_built_in_one(gen):
    ours, _ = build_backbone("resnet18")
    theirs, width = build_backbone("torchvision:resnet18")
    assert isinstance(theirs, ExternalBackbone) and theirs.reader == "resnet"
    theirs.net.load_state_dict(ours.state_dict(), strict=False)  # all but its classifier
    x = torch.randn(2, 3, 64, 64, generator=gen)
    a, b = backbone_tokens(ours.eval(), x), backbone_tokens(theirs.eval(), x)
    assert width == 512 and a.grid == b.grid == (2, 2)
    torch.testing.assert_close(b.cls, a.cls) and torch.testing.assert_close(b.patches, a.patches)
    torch.testing.assert_close(theirs(x), a.cls)


# torchvision families by their reader, each with its classifier's name: with
# the classifier replaced by Identity, the model's own forward gives the
# image's feature (the pooled map).
# (The ResNets' reader: the test above.)
FAMILIES = [
    ("swin_t", "swin", "head"),
    ("mobilenet_v3_small", "features", "classifier"),
    ("regnet_x_400mf", "regnet", "fc"),
    ("mnasnet0_5", "layers", "classifier"),
    ("shufflenet_v2_x0_5", "shufflenet", "fc"),
]


@pytest.mark.parametrize(("name", "reader", "classifier"), FAMILIES)
def test_a_torchvision_network_is_read_as_its_own_forward_gives_its_feature(
    name, reader, classifier, gen
):
    net, width = build_backbone(f"torchvision:{name}")
    assert net.reader == reader
    own = net.net.eval()
    x = torch.randn(2, 3, 64, 64, generator=gen)
    t = backbone_tokens(net, x)
    with torch.no_grad():
        setattr(own, classifier, torch.nn.Identity())
        torch.testing.assert_close(t.cls, own(x), rtol=1e-5, atol=1e-5)
    assert t.cls.shape == (2, width) and t.patches.shape[-1] == width


def _torchvision_vit(image_size: int) -> torchvision.models.VisionTransformer:
    return torchvision.models.VisionTransformer(
        image_size=image_size, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    )


def test_a_torchvision_vit_is_read_as_its_tokens_at_any_size(gen):
    """At its own size (32 pixels) the class token is the one its forward
    gives; at 64 its tokens are those of the same network built for 64
    pixels with the position table resized to the 8 x 8 grid."""
    with torch.device("meta"):
        big, width = build_backbone("torchvision:vit_b_32")
    assert (big.reader, width, big.prefix) == ("vit", 768, 1)
    net = ExternalBackbone(_torchvision_vit(32), "torchvision:vit", "vit").eval()
    own, x = net.net, torch.randn(2, 3, 32, 32, generator=gen)
    own.heads = torch.nn.Identity()
    with torch.no_grad():
        torch.testing.assert_close(backbone_tokens(net, x).cls, own(x), rtol=1e-5, atol=1e-5)
        larger = _torchvision_vit(64)
        larger.heads = torch.nn.Identity()
        table = resize_pos_embed(own.encoder.pos_embedding, (8, 8))
        larger.load_state_dict({**own.state_dict(), "encoder.pos_embedding": table})
        x = torch.randn(2, 3, 64, 64, generator=gen)
        t = backbone_tokens(net, x)
        assert t.grid == (8, 8) and t.patches.shape == (2, 64, 32)
        torch.testing.assert_close(t.cls, larger.eval()(x), rtol=1e-5, atol=1e-5)


def test_what_the_features_skip_is_frozen_and_every_other_parameter_learns(gen):
    """A torchvision classifier takes no part in the features: frozen (DDP
    refuses a parameter without a gradient), kept in the state dict its
    own class loads; after a step every trainable parameter has a gradient."""
    net, _ = build_backbone("torchvision:resnet18")
    assert net.unreached == ["fc.weight", "fc.bias"]
    assert not net.net.fc.weight.requires_grad and net.net.conv1.weight.requires_grad
    torchvision.models.resnet18().load_state_dict(net.net.state_dict())  # strict
    t = backbone_tokens(net.train(), torch.randn(2, 3, 64, 64, generator=gen))
    (t.cls.sum() + t.patches.sum()).backward()
    assert all(p.grad is not None for p in net.parameters() if p.requires_grad)
    assert build_backbone("timm:resnet18")[0].unreached == []  # built without a classifier
    with torch.device("meta"):  # found without compute
        assert build_backbone("torchvision:swin_t")[0].unreached == ["head.weight", "head.bias"]


def test_a_timm_vit_is_read_as_tokens_after_its_class_token(gen):
    net, width = build_backbone("timm:vit_tiny_patch16_224")
    x = torch.randn(2, 3, 64, 64, generator=gen)  # any size: built with dynamic_img_size
    out = net.net.eval().forward_features(x)
    t = backbone_tokens(net, x)
    assert (width, net.prefix, t.grid) == (192, 1, (4, 4))
    assert torch.equal(t.cls, out[:, 0]) and torch.equal(t.patches, out[:, 1:])


def test_a_functions_module_is_read_as_its_feature_map(gen):
    net, width = build_backbone(OWN)
    x = torch.randn(3, 3, 32, 32, generator=gen)
    fmap = net.net(x)  # the plain module: the map's average and its cells
    t = backbone_tokens(net, x)
    assert width == 24 and t.grid == (4, 4)
    torch.testing.assert_close(t.cls, fmap.mean((2, 3)))
    torch.testing.assert_close(t.patches, fmap.flatten(2).transpose(1, 2))
    with torch.device("meta"):  # the memory model builds students on the meta device
        assert build_backbone("timm:resnet18")[1] == 512


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("timm:resnet_nope", "timm 1.0"),
        ("torchvision:maxvit_t", "no feature map to read"),
        ("own_nets:pooled", "gives a tensor of shape [1, 8]"),
        ("own_nets:two_outputs", "gives a tuple of 2"),
        ("own_nets:not_a_module", "returned a Tensor, not a torch.nn.Module"),
        ("own_nets:fails", "calling fails() failed (RuntimeError: no weights here)"),
        ("own_nets:nothing", "cannot import it (AttributeError"),
        ("no_such_package.nets:f", "cannot import it (ModuleNotFoundError"),
    ],
)
def test_what_cannot_be_a_student_is_one_line(name, needle):
    with pytest.raises(ValueError) as e:
        build_backbone(name)
    assert needle in str(e.value) and name in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["model.backbone=timm:resnet18.a1_in1k"], "'.tag' names weights to download"),
        (["model.backbone=torchvision:"], "torchvision:NAME takes a model name"),
        (["model.backbone=resnet18:"], "is not timm:NAME, torchvision:NAME or package.module"),
        (["model.backbone=timm:resnet18"], "a network of your own is a student of recipe.name"),
        (
            [
                "recipe.name=distill",
                "recipe.distill.teacher=t.pth",
                "recipe.distill.students=[timm:resnet18]",
                "recipe.distill.students_init_from=[a,b]",
            ],
            "names 2 start(s) for 1 student(s)",
        ),
        (
            [
                "recipe.name=distill",
                "recipe.distill.teacher=t.pth",
                "model.backbone=vit_tiny",
                "recipe.distill.students=[vit_small]",
                "recipe.distill.students_init_from=[a]",
                "distributed.strategy=fsdp",
            ],
            "use distributed.strategy=ddp",
        ),
    ],
)
def test_bad_student_configs_are_one_line(overrides, needle):
    with pytest.raises(ConfigError) as e:
        apply_overrides(default_config(), overrides)
    assert needle in str(e.value)


def test_students_start_from_their_own_weights_and_so_do_their_emas(tmp_path):
    start = timm.create_model("resnet18", num_classes=10)  # with a classifier, left out
    torch.save(start.state_dict(), tmp_path / "r18.pth")
    cfg = load_config(
        None,
        [
            *STUDENTS,
            "recipe.distill.teacher=t.pth",
            f"recipe.distill.students_init_from=[{tmp_path / 'r18.pth'},none]",
        ],
    )
    student, ema = build_models(cfg)
    before = student.members[OWN].backbone.net[0].weight.clone()
    notes = start_students(cfg, student, ema)
    assert len(notes) == 1 and "its classifier left out: 2 tensors" in notes[0]
    member, member_ema = student.members["timm:resnet18"], ema.members["timm:resnet18"]
    assert torch.equal(member.backbone.net.conv1.weight, start.conv1.weight)
    assert torch.equal(member_ema.backbone.net.conv1.weight, start.conv1.weight)
    assert torch.equal(student.members[OWN].backbone.net[0].weight, before)  # 'none'
    torch.save({"conv1.weight": start.conv1.weight}, tmp_path / "part.pth")
    part = f"recipe.distill.students_init_from=[{tmp_path / 'part.pth'},none]"
    cfg = apply_overrides(cfg, [part])
    with pytest.raises(ValueError, match=r"part.pth does not fit timm:resnet18: missing"):
        start_students(cfg, student, ema)


@pytest.fixture(scope="module")
def trained(distill_data, distill_teacher, tmp_path_factory):
    """A ViT-T, a timm ResNet-18 (started from weights) and a function's
    CNN distilled together for one epoch, in this process."""
    tmp = tmp_path_factory.mktemp("any")
    start = timm.create_model("resnet18", num_classes=0)
    torch.save(start.state_dict(), tmp / "r18.pth")
    out, starts = tmp / "run", f"recipe.distill.students_init_from=[{tmp / 'r18.pth'},none]"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert (
            main(
                [
                    "train",
                    "--output-dir",
                    str(out),
                    "--quiet",
                    f"data.root={distill_data / 'train'}",
                    *STUDENTS,
                    f"recipe.distill.teacher={distill_teacher}",
                    starts,
                ]
            )
            == 0
        )
    return out, start


def test_a_run_trains_evaluates_and_exports_every_student(trained, tmp_path, capsys):
    out, start = trained
    report = json.loads((out / "report.json").read_text())
    assert any("timm:resnet18 from" in note for note in report["init_from"])
    assert {"timm:resnet18", OWN} <= set(report["students"])
    for name in ("timm:resnet18", OWN):
        assert "knn_top1_trained" in report["students"][name]
    # the started student is judged beside the weights it started from too
    started, fresh = report["students"]["timm:resnet18"], report["students"][OWN]
    assert "knn_top1_start" in started and "adapt_verdict" in started
    assert not any(k.endswith("_start") for k in fresh)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(f"loss_{OWN}" in r and "loss_timm:resnet18" in r for r in rows)
    state = final_state(out)["teacher"]
    # timm's own state dict, loaded by timm without the classifier
    target = tmp_path / "r18_timm.pth"
    assert (
        main(
            [
                "export",
                str(out),
                "--student",
                "timm:resnet18",
                "--format",
                "timm",
                "--output",
                str(target),
            ]
        )
        == 0
    )
    net = timm.create_model("resnet18", num_classes=0)
    net.load_state_dict(torch.load(target, weights_only=True))
    assert torch.equal(net.conv1.weight, state["members.timm:resnet18.backbone.net.conv1.weight"])
    assert not torch.equal(net.conv1.weight, start.conv1.weight)  # trained from its start
    # the function's module: its own state dict
    own = tmp_path / "own.pth"
    assert (
        main(["export", str(out), "--student", OWN, "--format", "dino", "--output", str(own)]) == 0
    )
    own_nets.small_cnn().load_state_dict(torch.load(own, weights_only=True))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(
            [
                "export",
                str(out),
                "--student",
                "timm:resnet18",
                "--format",
                "torchvision",
                "--output",
                str(tmp_path / "x.pth"),
            ]
        )
    assert "--format torchvision does not write a timm:resnet18 student; dino or timm" in (
        capsys.readouterr().err
    )


META = {TRAINING_KEY: json.dumps({"image_size": 96, "mean": [0.5] * 3, "std": [0.25] * 3})}


def test_a_built_in_resnet_is_written_for_torchvision_and_timm(tmp_path):
    net, _ = build_backbone("resnet18")
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    for fmt in ("torchvision", "timm"):
        path = tmp_path / f"{fmt}.pth"
        load, _ = export_cnn(fmt, sd, "resnet18", path, META, lambda: None)
        target = (
            torchvision.models.resnet18() if fmt == "torchvision" else timm.create_model("resnet18")
        )
        target.fc = torch.nn.Identity()
        target.load_state_dict(torch.load(path, weights_only=True))
        assert torch.equal(target.conv1.weight, net.conv1.weight) and fmt in load
        sidecar = json.loads(training_sidecar(path).read_text())[TRAINING_KEY]
        assert sidecar["image_size"] == 96  # the input it was trained at, beside the file
    with pytest.raises(ValueError, match="--format torchvision does not write a convnext_tiny"):
        export_cnn("torchvision", {}, "convnext_tiny", tmp_path / "c.pth", {}, lambda: None)


def test_a_students_key_is_its_name_without_dots():
    cfg = load_config(
        None,
        [*STUDENTS, "recipe.distill.teacher=t.pth", "recipe.distill.students=[pkg.nets:small]"],
    )
    assert cfg.student_names == ("vit_tiny", "pkg.nets:small")
    assert cfg.student_keys == ("vit_tiny", "pkg_nets:small")


class _NoMetaKernel(nn.Module):
    """A network with an operator that cannot run on the meta device (as a
    custom kernel without a meta implementation) and a parameter its output
    never reaches."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 16, stride=16)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        if x.device.type == "meta":
            raise NotImplementedError("no meta kernel")
        return self.conv(x)


def test_the_unreached_parameters_are_found_where_meta_cannot_run():
    net = _NoMetaKernel()
    assert unreached_parameters(net, "forward") == ["unused.weight", "unused.bias"]
    assert net.conv.weight.grad is None  # the probe's gradients touch nothing


def test_a_network_that_runs_nowhere_is_refused_in_one_line():
    class Broken(_NoMetaKernel):
        def forward(self, x):
            raise RuntimeError("shape mismatch")

    with pytest.raises(ValueError, match=r"Broken: one forward and backward .* failed"):
        unreached_parameters(Broken(), "forward")
