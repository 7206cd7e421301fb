V='[{"state_walk": 1, "walk_weights": 1, "scan_gluon": 3, "walk_block": 64}, {"state_walk": 1, "walk_weights": 1, "scan_gluon": 3}]'
sw() { timeout 170 python3 scripts/sweep_depths.py --out $OUT/$1 --stages --no-final-states --dtypes fp16 --shapes mamba2-2.7b:4x16384 --variants "$V" > $OUT/$1.log 2>&1; tail -3 $OUT/$1.log; }
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv
sw st4_new
cp abtmp/b/chunk_scan_gluon.jinja templates/ssd_fwd/; sw st4_b
cp abtmp/old/*.jinja templates/ssd_fwd/; cp abtmp/old/chunk.py autossd/ops/ssd/; sw st4_old
git -C . status >/dev/null 2>&1; cp abtmp/new/*.jinja templates/ssd_fwd/ 2>/dev/null
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv
