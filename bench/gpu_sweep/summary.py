"""Per config of a gpu_sweep JSONL: test error % per seed and mean (ULMFiT ensemble, each direction, TF-IDF) and
mean validation accuracy of the last round's members, the figure a config may be chosen on (no test labels).

    python bench/gpu_sweep/summary.py sweep.jsonl
"""
import json
import statistics as st
import sys

by: dict[str, list[dict]] = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    by.setdefault(r["tag"], []).append(r)
print(f"{'config':8} {'seeds':>6} {'ensemble per seed':>22} {'ens':>6} {'fwd':>6} {'bwd':>6} {'tfidf':>6} {'valid':>6}")
for tag, rows in by.items():
    rows.sort(key=lambda r: r["seed"])
    err = lambda v: [100 * r["errors"][v] for r in rows]  # noqa: E731
    per_seed = " ".join(f"{e:.2f}" for e in err("ulmfit_ensemble"))
    valid = st.mean(st.mean(r["valid"].values()) for r in rows)
    print(f"{tag:8} {len(rows):>6} {per_seed:>22} {st.mean(err('ulmfit_ensemble')):6.2f} "
          f"{st.mean(err('ulmfit_fwd')):6.2f} {st.mean(err('ulmfit_bwd')):6.2f} {st.mean(err('tfidf')):6.2f} "
          f"{100 * valid:6.2f}")
