#!/usr/bin/env bash
# Set up .venv (once), then train ResNet-18 on the built-in MNIST-5k digits (configs/demo.yaml)
# and print the final validation accuracy. Extra arguments go to main.py (e.g. --epochs 2).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/setup_env.sh"
cd "$REPO"
OUT="${DEMO_OUTPUT_DIR:-runs/demo}"
rm -f "$OUT/metrics.jsonl" "$OUT/checkpoint.pth.tar" "$OUT/model_best.pth.tar"
start=$(date +%s)
python main.py --config configs/demo.yaml --output-dir "$OUT" "$@"
python - "$OUT/metrics.jsonl" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
last = rows[-1]
print(f"demo: final val Acc@1 {last['val_acc1']:.2f}% (best {max(r['val_acc1'] for r in rows if r['val_acc1'] is not None):.2f}%) "
      f"after {len(rows)} epochs, {sys.argv[2]} s including start-up; outputs in {sys.argv[1].rsplit('/', 1)[0]}")
PY
