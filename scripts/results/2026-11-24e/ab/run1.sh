set -x
W='"state_walk": 1, "walk_weights": 1, "scan_gluon": 3'
V="[{$W}, {\"state_walk\": 1, \"scan_gluon\": 3}, {\"state_block_n\": 64, \"fold_prep\": 2, \"state_walk\": 1, \"walk_weights\": 1, \"scan_gluon\": 1, \"pdl\": 3}]"
sw() { timeout 150 python3 scripts/sweep_depths.py --out $OUT/$1 --stages --no-final-states --dtypes fp16 --shapes mamba2-2.7b:8x2048,mamba2-2.7b:1x2048 --variants "$V" > $OUT/$1.log 2>&1; tail -8 $OUT/$1.log; }
timeout 280 python3 scripts/gpu_validate.py --out $OUT/val --quick --long 0 --smem-pad '' --stored-only > $OUT/val.log 2>&1; tail -3 $OUT/val.log; grep -c FAIL $OUT/val.log
sw st_new
cp abtmp/b/chunk_scan_gluon.jinja templates/ssd_fwd/; sw st_b
cp abtmp/old/*.jinja templates/ssd_fwd/; cp abtmp/old/chunk.py autossd/ops/ssd/; sw st_old
