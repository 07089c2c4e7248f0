"""``schedule.epochs: auto`` (dino_opt.train.epochs): on file lists of 200,
2,000 and 200,000 images (no images needed: the choice counts the list) it
picks the values docs/training.md tables, scales the warm-ups and the
frozen last layer with them, says why in one line, and parses as a config
value beside a number."""

import pytest
from dino_opt.config import ConfigError, load_config
from dino_opt.train import auto_epochs, resolve_epochs
from dino_opt.train.epochs import MIN_STEPS


def _listed(tmp_path, n: int):
    path = tmp_path / f"list{n}.txt"
    path.write_text("".join(f"images/{i:06d}.jpg\n" for i in range(n)))
    return path


# images -> (epochs, optimizer steps) at batch 64 (docs/training.md's table); an
# epoch is images // 64 steps, as the training loader drops the last partial batch
TABLE = {200: (1667, 5001), 2_000: (162, 5022), 200_000: (100, 312_500)}


@pytest.mark.parametrize("images", sorted(TABLE))
def test_the_documented_choice_for_a_file_list(images, tmp_path):
    cfg = load_config(
        None,
        [
            f"data.root={_listed(tmp_path, images)}",
            "data.batch_size=64",
            "schedule.epochs=auto",
            "schedule.warmup_epochs=10",
            "schedule.warmup_teacher_temp_epochs=30",
        ],
    )
    resolved, line = resolve_epochs(cfg)
    epochs, steps = TABLE[images]
    s = resolved.schedule
    assert (s.epochs, s.warmup_epochs) == (epochs, round(10 * epochs / 100))
    assert s.warmup_teacher_temp_epochs == round(30 * epochs / 100)
    assert resolved.optim.freeze_last_layer == max(1, round(epochs / 100))
    assert line.startswith(f"schedule.epochs=auto: {epochs} epochs, {steps} optimizer steps")
    assert steps == epochs * (images // 64) >= MIN_STEPS
    assert f"({images} images" in line and "\n" not in line


def test_the_rule_beyond_imagenet_and_with_ranks():
    assert auto_epochs(14_000_000, 1024).epochs == 10  # ImageNet-22k: 100 ImageNet epochs' images
    # 8 ranks of 64 and 2 accumulated batches: 1,000-image steps
    one = auto_epochs(200_000, 64 * 8, accumulation=2)
    assert (one.steps_per_epoch, one.epochs) == (195, 100)
    # each rank's share padded to 25,000 images: 390 full batches of 64, 195 steps
    assert auto_epochs(200_000, 64 * 8, accumulation=2, world_size=8).steps == 19_500
    # 2,000 images on 3 ranks of 64: 667 a rank, 10 full batches each
    three = auto_epochs(2_000, 64 * 3, world_size=3)
    assert (three.steps_per_epoch, three.epochs) == (10, 500)


def test_a_number_is_kept_and_other_words_refused(tmp_path):
    cfg = load_config(None, ["schedule.epochs=17"])
    assert resolve_epochs(cfg) == (cfg, None)
    with pytest.raises(ConfigError, match="schedule.epochs must be an int or auto, got 'often'"):
        load_config(None, ["schedule.epochs=often"])
    assert load_config(None, ["schedule.epochs=auto", "schedule.warmup_epochs=500"])
