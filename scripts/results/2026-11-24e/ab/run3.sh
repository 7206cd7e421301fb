V='[{"state_walk": 1, "walk_weights": 1, "scan_gluon": 3, "walk_block": 64}]'
sw() { timeout 100 python3 scripts/sweep_depths.py --out $OUT/$1 --stages --no-final-states --dtypes fp16 --shapes mamba2-2.7b:4x16384 --variants "$V" > $OUT/$1.log 2>&1; echo $1; tail -1 $OUT/$1.log; }
for v in wA wB wC wD; do cp abtmp/$v/state_walk_gluon.jinja templates/ssd_fwd/; sw st5_$v; done
cp abtmp/wA/state_walk_gluon.jinja templates/ssd_fwd/; sw st5_wA2
