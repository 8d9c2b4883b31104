#!/usr/bin/env bash
# This tree against another, alternately in one lease, on the GPU machine after activate.sh flash.
# usage: OLD_TREE=DIR benchmarks/gpu_tree_ab.sh bench|latency ROUNDS   (logs under $OUT)
mode=$1; rounds=${2:-2}
new=$PWD; old=${OLD_TREE:?set OLD_TREE to a checkout of the commit to compare against (git archive COMMIT nanoplug | tar -x -C DIR)}
site=/tmp/site:/tmp/site-fa4:/tmp/site-fa4/nvidia_cutlass_dsl/dsl_packages
args="--attention flash --kv-cache triton"; [ "$mode" = latency ] && args="$args --latency"
for r in $(seq $rounds); do
  for tree in new old; do
    dir=$new; [ $tree = old ] && dir=$old
    echo "=== $mode round $r $tree"
    (cd /tmp && PYTHONPATH=$dir:$site timeout 280 python3 -m nanoplug bench $args 2>&1 | tee $OUT/${mode}_${tree}_$r.log | grep -v "^WARNING\|Warning" | tail -6)
  done
done
