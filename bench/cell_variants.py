"""One benchmark cell under several settings: validation accuracy first, test accuracy beside it, never chosen on.

Reuses a finished `transfer benchmark --out OUT` run's domain LMs (OUT/work/DATASET) and trains each variant's
classifiers in OUT/work/DATASET/variants/NAME-BUDGET-sSEED, so the benchmark's own cells and results.csv stay
untouched. A variant is NAME=OVERRIDE[;OVERRIDE...] (`-S` syntax), applied after the suite's and the cell's
overrides; `NAME=` alone is the suite as it is. A finished variant is read back, not retrained.

    python bench/cell_variants.py SUITE OUT DATASET base= last6='classifier.unfreeze_epochs=[1,1,1,6]' \
        --budget all --seeds 0 1 2 [--json rows.jsonl]      (variants before the options)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from flows.cells import run_cell
from transfer.benchmark import cell_overrides, load_suite


def variant(spec: str) -> tuple[str, list[str]]:
    name, _, overrides = spec.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"{spec!r}: a variant is NAME=OVERRIDE[;OVERRIDE...]")
    return name, [o for o in overrides.split(";") if o]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite", type=Path)
    ap.add_argument("out", type=Path, help="the benchmark's --out folder (its domain LMs are reused)")
    ap.add_argument("dataset")
    ap.add_argument("variants", nargs="+", type=variant)
    ap.add_argument("--budget", default="all")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--json", type=Path, help="append one JSON row per variant and seed")
    args = ap.parse_args()
    suite = load_suite(args.suite)
    dataset = next(d for d in suite.datasets if d.name == args.dataset)
    dataset_ws = args.out / "work" / dataset.name
    for seed in args.seeds:
        for name, extra in args.variants:
            p = suite.params_for(dataset, [*cell_overrides(args.budget, seed), *extra])
            ws = dataset_ws / "variants" / f"{name}-{args.budget}-s{seed}"
            t0 = time.perf_counter()
            result = run_cell(p, ws, dataset_ws)
            clas = json.loads((ws / "metrics" / "train_classifier.json").read_text())
            test = {v: m["accuracy"] for v, m in result.evaluation["variants"].items()}
            resolved = result.prep.get("rules", {})
            row = dict(dataset=dataset.name, budget=args.budget, seed=seed, variant=name, overrides=extra,
                       valid_accuracy=clas["ensemble"]["valid_accuracy"],
                       self_training=clas.get("self_training", {}), test_accuracy=test,
                       rules={k: v["value"] for k, v in resolved.items()}, seconds=round(time.perf_counter() - t0, 1))
            print(f"{dataset.name} {args.budget} s{seed} {name:>10}: valid {row['valid_accuracy']:.4f}  "
                  + "  ".join(f"{k} {v:.4f}" for k, v in test.items()) + f"  ({row['seconds']:.0f} s)", flush=True)
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
