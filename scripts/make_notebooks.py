"""Writes notebooks/*.ipynb from the cell sources below (the notebooks are
generated, so that their code is reviewed as Python and stays lint-clean)."""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent.parent / "notebooks"

MEMORY = [
    new_markdown_cell(
        "# Memory optimisation benchmark (Lesson 5.4, exercise 1)\n\n"
        "Peak memory and time of one DINO training step with `MemoryOptimizedDINOTrainer` "
        "in four set-ups: baseline (fp32), mixed precision, gradient checkpointing, and both. "
        "On a CPU it runs a small ViT-T/16 at 64/32 px in seconds (peak memory is the "
        "process's RSS, which moves little); on a GPU it runs ViT-S/16 at DINO's "
        "224/96 px and reports the allocator's peak."
    ),
    new_code_cell(
        "import time\n\n"
        "import torch\n"
        "from dino_opt.config import Config, apply_overrides\n"
        "from dino_opt.lessons import MemoryOptimizedDINOTrainer, MemoryTracker\n"
        "from dino_opt.loss import DINOLoss\n"
        "from dino_opt.trainer import DINOModel, build_models, param_groups\n\n"
        "gpu = torch.cuda.is_available()\n"
        "device = torch.device('cuda' if gpu else 'cpu')\n"
        "size = dict(backbone='vit_small', batch=64, global_px=224, local_px=96, n_local=8,\n"
        "            out_dim=65536) if gpu else dict(backbone='vit_tiny', batch=8, global_px=64,\n"
        "            local_px=32, n_local=4, out_dim=1024)\n"
        "size"
    ),
    new_code_cell(
        "def one_setup(precision, checkpointing, steps=3):\n"
        "    torch.manual_seed(0)\n"
        "    cfg = apply_overrides(Config(), [f\"model.backbone={size['backbone']}\",\n"
        "                                     f\"model.out_dim={size['out_dim']}\"])\n"
        "    student, teacher = build_models(cfg)\n"
        "    model = DINOModel(student.to(device), teacher.to(device), 0.996)\n"
        "    ncrops = 2 + size['n_local']\n"
        "    loss = DINOLoss(size['out_dim'], ncrops, 0.04, 0.04, 0, 10).to(device)\n"
        "    opt = torch.optim.AdamW(param_groups(student), lr=1e-4)\n"
        "    trainer = MemoryOptimizedDINOTrainer(model, loss, opt, {\n"
        "        'precision': precision, 'gradient_checkpointing': checkpointing}, device)\n"
        "    b = size['batch']\n"
        "    crops = [torch.randn(b, 3, size['global_px'], size['global_px'], device=device)\n"
        "             for _ in range(2)]\n"
        "    crops += [torch.randn(b, 3, size['local_px'], size['local_px'], device=device)\n"
        "              for _ in range(size['n_local'])]\n"
        "    tracker = MemoryTracker(device)\n"
        "    times, peaks = [], []\n"
        "    for _ in range(steps):\n"
        "        tracker.start_step()\n"
        "        t0 = time.perf_counter()\n"
        "        trainer.train_step_optimized(crops, epoch=1)\n"
        "        trainer.optimize_step()\n"
        "        if gpu:\n"
        "            torch.cuda.synchronize()\n"
        "        times.append(time.perf_counter() - t0)\n"
        "        s = tracker.end_step()\n"
        "        peaks.append(s['device_peak_allocated'] if gpu else s['host_peak_rss'])\n"
        "    return {'seconds_per_step': sorted(times)[len(times) // 2],\n"
        "            'peak_gib': max(peaks) / 2**30}\n\n"
        "low = 'bf16' if (not gpu or torch.cuda.is_bf16_supported()) else 'fp16'\n"
        "setups = {'baseline (fp32)': ('fp32', False), f'mixed precision ({low})': (low, False),\n"
        "          'gradient checkpointing': ('fp32', True), 'both': (low, True)}\n"
        "results = {name: one_setup(*args) for name, args in setups.items()}\n"
        "base = results['baseline (fp32)']\n"
        "print(f\"{'set-up':28s} {'s/step':>8s} {'peak GiB':>9s} {'memory':>7s} {'speed':>6s}\")\n"
        "for name, r in results.items():\n"
        "    print(f\"{name:28s} {r['seconds_per_step']:8.3f} {r['peak_gib']:9.2f} \"\n"
        "          f\"{r['peak_gib'] / base['peak_gib']:6.2f}x \"\n"
        "          f\"{base['seconds_per_step'] / r['seconds_per_step']:5.2f}x\")"
    ),
    new_code_cell(
        "import matplotlib\n\n"
        "matplotlib.use('Agg')\n"
        "import matplotlib.pyplot as plt\n\n"
        "fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))\n"
        "names = list(results)\n"
        "axes[0].barh(names, [results[n]['peak_gib'] for n in names])\n"
        "axes[0].set_xlabel('peak memory (GiB)')\n"
        "axes[1].barh(names, [results[n]['seconds_per_step'] for n in names])\n"
        "axes[1].set_xlabel('seconds per step')\n"
        "fig.tight_layout()"
    ),
    new_markdown_cell(
        "Read the GPU numbers, not the CPU ones: on a CPU the process's RSS includes the "
        "framework and the allocator's cache, and bf16 autocast is slower than fp32 on most "
        "CPUs. On a GPU, checkpointing trades speed for activation memory and bf16 halves "
        "the activations."
    ),
]


def main() -> None:
    HERE.mkdir(exist_ok=True)
    for name, cells in {"memory_optimization.ipynb": MEMORY}.items():
        for i, cell in enumerate(cells):
            cell.id = f"cell-{i}"  # fixed ids: the same script writes the same file
        nb = new_notebook(cells=cells)
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}  # fmt: skip
        nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    main()
