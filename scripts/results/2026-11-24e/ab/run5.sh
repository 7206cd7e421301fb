V='[{"state_walk": 1, "walk_weights": 1, "scan_gluon": 3}, {"state_walk": 1, "scan_gluon": 3}]'
sw() { timeout 100 python3 scripts/sweep_depths.py --out $OUT/$1 --stages --no-final-states --dtypes fp16 --shapes mamba2-2.7b:8x2048,mamba2-2.7b:4x16384 --variants "$V" > $OUT/$1.log 2>&1; echo $1; grep -o 'graph *[0-9.]* ms\|"state_walk": 0[0-9.]*\|"chunk_scan": [0-9.]*' $OUT/$1.log | tr '\n' ' '; echo; }
for v in wE wF wE wF; do cp abtmp/$v/state_walk_gluon.jinja templates/ssd_fwd/; sw st7_$v; done
