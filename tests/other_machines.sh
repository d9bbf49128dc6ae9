#!/usr/bin/env bash
# The parity tests under every CPU kernel path this machine offers, and each bound against its measured worst.
#
# PyTorch's CPU kernels dispatch on the processor's vector width, so the same code rounds differently on
# another machine; ATEN_CPU_CAPABILITY picks the path (default, avx2, and avx512 where the processor has it),
# as ONEDNN_MAX_CPU_ISA does for oneDNN's kernels. Run this before every change that touches numerics:
#
#     bash tests/other_machines.sh                 # every parity test, under each capability
#     bash tests/other_machines.sh -k cp2          # pytest options pass through
#
# Each parity comparison (tests/parallel_cases.assert_matches_reference) appends its measured error and its
# bound to PARATRAIN_ERROR_REPORT; the table at the end lists, per comparison, the worst under each capability
# and the bound's margin over the worst of them, flagged where it is under 10x. Exit status: 1 if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PARITY=(tests/parallel/data/test_data_parallel.py tests/parallel/data/test_zero3.py tests/parallel/data/test_zero3_overlap.py tests/parallel/data/test_hybrid_shard.py
        tests/parallel/tensor/test_tensor_parallel.py tests/parallel/tensor/test_parallel_2d.py tests/parallel/pipeline/test_pipeline.py tests/parallel/context/test_context_parallel.py
        tests/parallel/expert/test_expert_parallel.py tests/parallel/expert/test_expert_parallel_compose.py tests/parallel/test_precision.py
        tests/parallel/test_compile.py tests/parallel/test_your_own_model.py tests/parallel/test_parity_faults.py
        tests/run/test_train.py::test_accumulation_with_uneven_masks_equals_one_batch)
capabilities=(default avx2)
grep -qw avx512f /proc/cpuinfo 2>/dev/null && capabilities+=(avx512)
reports=${PARATRAIN_REPORT_DIR:-$(mktemp -d)}
status=0
for capability in "${capabilities[@]}"; do
    echo "== ATEN_CPU_CAPABILITY=$capability"
    rm -f "$reports/$capability.jsonl"
    start=$SECONDS
    ATEN_CPU_CAPABILITY=$capability PARATRAIN_ERROR_REPORT="$reports/$capability.jsonl" \
        python -m pytest -q -p no:cacheprovider "${PARITY[@]}" "$@" || status=1
    echo "== $capability: $((SECONDS - start)) s"
done
python - "$reports" "${capabilities[@]}" <<'PY'
import json, sys
from pathlib import Path
reports, capabilities = Path(sys.argv[1]), sys.argv[2:]
worst, bounds = {}, {}
for cap in capabilities:
    path = reports / f"{cap}.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        key = (r["test"], r["what"])
        bounds[key] = r["bound"]
        worst.setdefault(key, {})[cap] = max(worst.get(key, {}).get(cap, 0.0), r["measured"])
short = [k for k in worst if bounds[k] and max(worst[k].values()) * 10 > bounds[k]]
print(f"\n{len(worst)} comparisons; worst measured error per capability, the bound, and its margin over the worst")
print(f"{'comparison':<100} " + " ".join(f"{c:>9}" for c in capabilities) + f" {'bound':>9} {'margin':>8}")
for key in sorted(worst, key=lambda k: -max(worst[k].values()) / (bounds[k] or 1)):
    w = worst[key]
    margin = bounds[key] / max(w.values()) if max(w.values()) else float("inf")
    print(f"{(key[0] + ' ' + key[1])[-100:]:<100} " + " ".join(f"{w.get(c, float('nan')):9.2e}" for c in capabilities)
          + f" {bounds[key]:9.1e} {margin:8.0f}{'  < 10x' if key in short else ''}")
print(f"\n{len(short)} bound(s) within 10x of a measured error")
PY
exit $status
