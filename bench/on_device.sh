#!/usr/bin/env bash
# One device call, several steps: `bash bench/on_device.sh STEP[@SECONDS] ...` from the repository
# root on a GPU machine. Each step runs under its own time cap (default 120 s) with its log and
# results in $OUT/<step>/ (a step's cap after an @: fp8_bench@200); at the end everything is packed into $OUT/results.tgz (a lent machine
# returns at most 8 files) and one line per step says how it ended. Steps:
#   gpu-tests       python3 -P -m pytest -q -n 8 tests/gpu (log named by the commit)
#   gpu:PATH        python3 -P -m pytest -q PATH (one file or folder of tests/gpu)
#   <script>        python3 bench/<script>.py --out $OUT/<script> (fp8_bench, fp4_moe_bench, ...);
#                   arguments after + signs: serving_bench+--budget-s+200
#   section-N       python3 bench/run.py --sections N --out $OUT/section-N
set -uo pipefail
: "${OUT:?set OUT to the folder results go to}"
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source bench/device_env.sh
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # COMMIT=: where the copy has no .git
dirty=${DIRTY-$(git status --porcelain 2>/dev/null | grep -qv "^??" && echo "+changes")}
export SPECDEPLOY_BENCH_COMMIT="$commit${dirty:+-dirty}"  # bench/common.py source_commit: the copy's .git may be stale
summary=()
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
for arg in "$@"; do
  step=${arg%@*}; cap=120
  [[ $arg == *@* ]] && cap=${arg##*@}
  dir="$OUT/${step%%+*}"; dir="$OUT/$(basename "${dir//[^A-Za-z0-9_.\/-]/_}")"; mkdir -p "$dir"
  t0=$(date +%s)
  case $step in
    gpu-tests) cmd=(python3 -P -m pytest -q -n 8 -p no:cacheprovider tests/gpu) ;;
    gpu:*) cmd=(python3 -P -m pytest -q -p no:cacheprovider "${step#gpu:}") ;;
    section-*) cmd=(python3 bench/run.py --sections "${step#section-}" --out "$dir") ;;
    *) IFS=+ read -r -a words <<<"$step"; cmd=(python3 "bench/${words[0]}.py" --out "$dir" "${words[@]:1}") ;;
  esac
  echo "=== $step (cap ${cap}s): ${cmd[*]}"
  log="$dir/log.txt"; [[ $step == gpu* ]] && log="$dir/gpu_tests_${commit}${dirty:+_dirty}.log"
  timeout --signal=INT --kill-after=15 "$cap" "${cmd[@]}" 2>&1 | tee "$log" | tail -n 25
  rc=${PIPESTATUS[0]}
  summary+=("$step: rc=$rc in $(( $(date +%s) - t0 )) s")
done
[[ -n ${DG_JIT_CACHE_DIR:-} && -d $DG_JIT_CACHE_DIR ]] && cp -r "$DG_JIT_CACHE_DIR" "$OUT/dg-jit-cache"  # for the next call's .dg/jit-cache
ls .dg/_C*.so >/dev/null 2>&1 || { ls /tmp/deepgemm/deep_gemm/_C*.so >/dev/null 2>&1 && mkdir -p "$OUT/dg-build" \
  && cp /tmp/deepgemm/deep_gemm/_C*.so "$OUT/dg-build/"; }  # a fresh build, for the next call's .dg/
(cd "$OUT" && tar czf results.tgz --exclude=results.tgz ./*)
printf '%s\n' "=== summary (commit $commit$dirty)" "${summary[@]}"
