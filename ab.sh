# fourteenth session A/B: three trees (ab_old = 6240569, ab_pk = a5a10d5, . = d896809)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/.whl/pyt PYTHONUNBUFFERED=1
SH=mamba2-2.7b:1x131072,codestral-7b:1x131072,mamba2-2.7b:4x16384,mamba2-2.7b:8x2048,mamba2-2.7b:1x2048
name() { if [ "$1" = . ]; then echo new; else echo $1; fi; }
sweep() {  # round tree
  n=$(name $2); mkdir -p $OUT/r$1_$n
  AUTOSSD_CACHE_DIR=/tmp/ac_$n AUTOSSD_DATA_DIR=/tmp/ad_$n python3 $2/scripts/sweep_depths.py --stages --dtypes ${DTYPES:-fp16} \
    --shapes $SH --variants '[{"launches":5}]' --out $OUT/r$1_$n > $OUT/r$1_$n.log 2>&1
  grep -h "launches" $OUT/r$1_$n.log | cut -c1-20,75-250
}
validate() {
  n=$(name $1); mkdir -p $OUT/val_$n
  AUTOSSD_CACHE_DIR=/tmp/ac_$n AUTOSSD_DATA_DIR=/tmp/ad_$n python3 $1/scripts/gpu_validate.py --quick --long 0 --smem-pad "" --depths 5 --out $OUT/val_$n > $OUT/val_$n.log 2>&1
  tail -1 $OUT/val_$n.log
}
