#!/usr/bin/env bash
# Lever sweep on one GPU machine without Prefect/MLflow (the device run of the ablation row of docs/results/README.md
# "self-training levers at 100 labels"): the fwd general LM (the bwd one's lm-bwd.pt already in WS), the
# domain LMs, then 5 classifier configs x 3 seeds at 100 labels, all 15 cells at once, each its own process.
#   WS=.devcarry/ws DATA=.devcarry/data bash bench/gpu_sweep/run.sh   (from the repo root; OUT: where results go)
# WS holds params.yaml (examples/ag_news.yaml), artifacts/tokenize/{spm.model,general.npy} and
# artifacts/pretrain/lm-bwd.pt; DATA the AG News split's train.csv and test.csv.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DATA=${DATA:?} OUT=${OUT:-.}
W=${WS:?}
timeout 200 python3 bench/gpu_sweep/lm.py $W fwd > $OUT/run2.log 2>&1; echo "pretrain rc=$?"
grep -v Warn $OUT/run2.log | grep -v "^{" | tail -8
f=$W/artifacts/pretrain/checkpoint-fwd.slim.pt
[ -f $f ] && sha256sum $f | tee $OUT/slim.sha256 && split -b 15M $f $OUT/slim.part.
cp $W/plots/pretrain_history.csv $OUT/ 2>/dev/null
timeout 120 python3 bench/gpu_sweep/domain.py $W >> $OUT/run2.log 2>&1; echo "finetune rc=$?"; grep "^finetune_lm" $OUT/run2.log | tail -3
declare -A C=([base]="" [m3]="classifier.members=3" [st4]="classifier.self_train_rounds=4" \
  [pl8]="classifier.pseudo_label_frac=0.8" [st4pl8]="classifier.self_train_rounds=4 classifier.pseudo_label_frac=0.8")
left=$((530 - SECONDS)); echo "sweep budget ${left}s"
for tag in base m3 st4 pl8 st4pl8; do for s in 0 1 2; do
  timeout $left python3 bench/gpu_sweep/cell.py $W /tmp/cells/$tag-$s $OUT/sweep.jsonl $tag 100 $s ${C[$tag]} > /tmp/cell-$tag-$s.log 2>&1 &
done; done
wait; echo "sweep done at $(date +%T)"
python3 bench/gpu_sweep/summary.py $OUT/sweep.jsonl
for l in /tmp/cell-*.log; do grep -q '"tag"' $l || { echo "== $l (no result)"; grep -v Warn $l | tail -3; }; done
