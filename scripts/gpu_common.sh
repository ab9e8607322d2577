# Sourced by scripts/gpu_check.sh and scripts/gpu_first_contact.sh, from the repository root.
#
# The interpreter for the GPU checks: PY is ${PYTHON} when set, else the first of the project venv's python and
# python3 that imports torch (a venv left half-made by a failed offline setup has a python without torch; a lent GPU
# machine's python3 has torch), else python3; TORCH_CUDA is "<1 when torch can use CUDA, else 0> <torch version>
# <torch's CUDA version>" ("0 none none" when the interpreter cannot import torch). It says which it passed over.
torch_probe='import torch; print(int(torch.cuda.is_available()), torch.__version__, torch.version.cuda)'
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
    TORCH_CUDA="$("$PY" -c "$torch_probe" 2>/dev/null || echo "0 none none")"
else
    PY="" TORCH_CUDA="0 none none"
    for candidate in .venv/bin/python python3; do
        command -v "$candidate" >/dev/null || continue
        if TORCH_CUDA="$("$candidate" -c "$torch_probe" 2>/dev/null)"; then PY="$candidate"; break; fi
        echo "$(basename "$0"): $candidate cannot import torch; not using it"
        TORCH_CUDA="0 none none"
    done
    PY="${PY:-python3}"
fi
echo "$(basename "$0"): python: $PY"

failed=()
# step NAME SECONDS COMMAND...: run COMMAND under a time limit, its output also to $WORK/NAME.log; a line
# "NAME RC SECONDS" goes to $WORK/steps.tsv and a failed step's NAME to the array `failed`.
step() {
    local name=$1 limit=$2 rc=0 began=$SECONDS
    shift 2
    echo "== $name (limit ${limit} s) =="
    timeout "$limit" "$@" 2>&1 | tee "$WORK/$name.log" || rc=$?
    echo "-- $name: $([[ $rc -eq 0 ]] && echo ok || echo "FAILED (rc=$rc)") in $((SECONDS - began)) s"
    echo "$name $rc $((SECONDS - began))" >> "$WORK/steps.tsv"
    [[ $rc -eq 0 ]] || failed+=("$name")
}
