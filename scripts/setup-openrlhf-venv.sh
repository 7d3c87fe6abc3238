#!/usr/bin/env bash
# Create (or bring up to date) .venv-openrlhf: OpenRLHF 0.11.x on CPU, next to rlwatch in editable
# mode, for tests/test_openrlhf*.py. Idempotent: a stamp file skips the work when nothing changed
# (FORCE=1 redoes it). Needs only python3 and pip; run as any user that can write the repo.
#
# OpenRLHF pins transformers 5.15 and ray 2.55, which conflict with the main .venv (TRL, verl), so it
# gets its own environment. `pip install openrlhf` does not work on a CPU machine (flash-attn's sdist
# needs torch and CUDA at build time, vllm pulls CUDA wheels), so:
#   1. torch==$TORCH_VERSION first (the CPU wheel; a plain `torch` would fetch GBs of CUDA wheels),
#      and every later step is constrained to that torch;
#   2. openrlhf==$OPENRLHF_VERSION with --no-deps, then its own requirements (read from the installed
#      metadata) minus flash-attn, deepspeed and vllm;
#   3. deepspeed at the version that openrlhf release pins, built without its CUDA ops
#      (DS_BUILD_OPS=0, --no-build-isolation so that the build sees the installed torch);
#   4. OpenRLHF 0.11.0 as a second, source-only copy under $VENV/openrlhf-0.11.0 (pure Python,
#      --no-deps --target): tests/test_openrlhf*.py run their version-dependent checks against it
#      in a subprocess, so both PolicyLoss/IS-flag variants are tested from one environment;
#   5. rlwatch itself (pip install -e .) and the test tools.
#
# Environment: VENV (.venv-openrlhf), PYTHON (python3), TORCH_VERSION (2.13.0), TORCH_INDEX (a pip
# index for torch only, e.g. https://download.pytorch.org/whl/cpu; default: pip's), OPENRLHF_VERSION
# (0.11.2), OPENRLHF_OLD_VERSION (0.11.0; empty to skip step 4), FORCE=1.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-.venv-openrlhf}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
OPENRLHF_VERSION="${OPENRLHF_VERSION:-0.11.2}"
OPENRLHF_OLD_VERSION="${OPENRLHF_OLD_VERSION-0.11.0}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

started=$(date +%s)
stamp_key="$(cat "$0" pyproject.toml | sha256sum | cut -c1-16)-$TORCH_VERSION-$OPENRLHF_VERSION-$OPENRLHF_OLD_VERSION"
STAMP="$VENV/.rlwatch-openrlhf-$stamp_key"
if [[ -f "$STAMP" && "${FORCE:-0}" != "1" ]] && "$PY" -c "
import importlib.metadata as m
for p in ('openrlhf', 'deepspeed', 'torch', 'ray', 'transformers', 'rlwatch-llm', 'pytest'):
    m.version(p)" 2>/dev/null; then
    echo "$VENV is up to date ($STAMP)"
    exit 0
fi

step() { echo "[setup-openrlhf-venv +$(( $(date +%s) - started ))s] $*"; }

if [[ ! -x "$PY" ]]; then
    step "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
"${PIP[@]}" --upgrade pip setuptools wheel

# 1. CPU torch, and a constraints file that keeps it for every later step.
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
    step "installing torch==$TORCH_VERSION"
    "${PIP[@]}" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==$TORCH_VERSION"
fi
if "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"; then
    echo "warning: the torch in $VENV is a CUDA build ($("$PY" -c 'import torch; print(torch.__version__)')); " \
         "rlwatch's OpenRLHF tests only need the CPU one" >&2
fi
CONSTRAINTS="$VENV/rlwatch-constraints.txt"
echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
PIPC=("${PIP[@]}" -c "$CONSTRAINTS")

# 2. openrlhf without its dependencies, then its requirements minus the GPU-only ones.
step "installing openrlhf==$OPENRLHF_VERSION (--no-deps)"
"${PIPC[@]}" --no-deps "openrlhf==$OPENRLHF_VERSION"
mapfile -t REQS < <("$PY" - <<'EOF'
import importlib.metadata, re
skip = {"flash-attn", "flash_attn", "deepspeed", "vllm", "torch"}
for req in importlib.metadata.requires("openrlhf") or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[\s;<>=!~\[]", req, 1)[0]
    if name.lower().replace("_", "-") not in skip:
        print(req.split(";")[0].strip())
EOF
)
DEEPSPEED_PIN="$("$PY" - <<'EOF'
import importlib.metadata
for req in importlib.metadata.requires("openrlhf") or []:
    if req.replace(" ", "").startswith("deepspeed=="):
        print(req.replace(" ", "").split(";")[0])
        break
else:
    print("deepspeed")
EOF
)"
step "installing openrlhf's requirements (without flash-attn, deepspeed, vllm): ${#REQS[@]} packages"
"${PIPC[@]}" "${REQS[@]}"

# 3. deepspeed, CPU only: no ops built, build against the installed torch.
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if 'deepspeed==' + m.version('deepspeed') == '$DEEPSPEED_PIN' else 1)" 2>/dev/null; then
    step "installing $DEEPSPEED_PIN (DS_BUILD_OPS=0)"
    # deepspeed's setup.py needs these at build time; --no-build-isolation does not fetch them.
    "${PIPC[@]}" ninja packaging psutil py-cpuinfo hjson msgpack numpy pydantic
    DS_BUILD_OPS=0 "${PIPC[@]}" --no-build-isolation "$DEEPSPEED_PIN"
fi

# 4. the older 0.11 release, source only, for the version-difference tests.
if [[ -n "$OPENRLHF_OLD_VERSION" ]]; then
    OLD_DIR="$VENV/openrlhf-$OPENRLHF_OLD_VERSION"
    if [[ ! -f "$OLD_DIR/openrlhf/__init__.py" ]] || [[ "${FORCE:-0}" == "1" ]]; then
        step "unpacking openrlhf==$OPENRLHF_OLD_VERSION into $OLD_DIR (source only, --no-deps)"
        rm -rf "$OLD_DIR"
        "${PIP[@]}" --no-deps --no-compile --target "$OLD_DIR" "openrlhf==$OPENRLHF_OLD_VERSION"
        rm -rf "$OLD_DIR/tests" "$OLD_DIR/bin"
    fi
fi

# 5. rlwatch (editable) and the test tools.
step "installing rlwatch (editable) and pytest, hypothesis, requests"
"${PIPC[@]}" -e . pytest hypothesis requests

step "checking"
"$PY" - <<'EOF'
import importlib.metadata as m
import torch
versions = {p: m.version(p) for p in ("openrlhf", "deepspeed", "transformers", "ray", "torch", "rlwatch-llm")}
print(" ".join(f"{k}=={v}" for k, v in versions.items()), "cuda:", torch.version.cuda)
import deepspeed, openrlhf, ray, rlwatch  # noqa: E401,F401
import openrlhf.trainer.ppo_utils.experience  # noqa: F401
EOF
rm -f "$VENV"/.rlwatch-openrlhf-*
touch "$STAMP"
step "done: $VENV"
