#!/usr/bin/env bash
# API reference from the docstrings, with pdoc (pip install -e ".[docs]"): writes docs/api/.
# Usage: scripts/build_docs.sh [OUTPUT_DIR]     (default docs/api; $PYTHON picks the interpreter, default python)
# Fails on any warning pdoc prints (tests/test_readme.py runs this).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/api}"
# the public modules; leanfa.bench and leanfa.kernels are internals and stay out
modules=(leanfa leanfa.api leanfa.quant leanfa.scales leanfa.reference leanfa.ops
         leanfa.flash_attn_interface leanfa.compat.flash_attn leanfa.integrations.transformers
         leanfa._versions)
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
TRITON_INTERPRET="${TRITON_INTERPRET:-1}" "${PYTHON:-python}" -m pdoc \
    --docformat restructuredtext --no-search -o "$out" "${modules[@]}" 2>"$log" || { cat "$log" >&2; exit 1; }
if [ -s "$log" ]; then
    echo "pdoc printed warnings:" >&2
    cat "$log" >&2
    exit 1
fi
echo "API reference written to $out/index.html"
