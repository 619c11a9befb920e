#!/usr/bin/env bash
# Every check that needs a GPU, in one run on the lent GPU machine (15 minutes of device time a
# session, machine start included): the CUDA tests and the BERT-large what-if study of issue 5.
#
#   here:        make gpu-kit      # wheels of neuronabox's dependencies and pytest, for Pythons 3.10-3.13
#   the device:  command "bash benchmarks/gpu_checks.sh", carry [".gpu-kit"], timeout_s 540
#
# The device has torch with CUDA, NCCL, Triton and transformers but no package index, so what
# neuronabox needs beside them is installed from the carried wheels (only what is missing, into
# a folder of its own). matplotlib is not among them (its wheels for four Pythons outweigh what
# a run may carry): without it the sweep writes its CSV, table and whatif.json, and
# `nbox report OUT/gpu_whatif/whatif.json` draws the plot back here. Everything lands under
# $OUT (the folder the device tool brings back), else ./gpu-out.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-gpu-out}
mkdir -p "$out"
exec > >(tee "$out/gpu_checks.log") 2>&1
py=$(command -v python3 || command -v python)
started=$SECONDS

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
"$py" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")'

echo "== dependencies (import name:wheel name; installed only where missing)"
site=$(mktemp -d /tmp/nbox-site.XXXXXX)
need=(pydantic:pydantic pydantic_core:pydantic-core typing_extensions:typing-extensions annotated_types:annotated-types
      typing_inspection:typing-inspection yaml:PyYAML jinja2:Jinja2 markupsafe:MarkupSafe networkx:networkx
      typer:typer shellingham:shellingham rich:rich markdown_it:markdown-it-py mdurl:mdurl
      pygments:Pygments annotated_doc:annotated-doc prometheus_client:prometheus-client psutil:psutil
      pyroute2:pyroute2 wrapt:wrapt pynvml:nvidia-ml-py pytest:pytest pluggy:pluggy iniconfig:iniconfig packaging:packaging
      exceptiongroup:exceptiongroup tomli:tomli)
missing=()
for pair in "${need[@]}"; do
    "$py" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
echo "missing: ${missing[*]:-none}"
kit=(-m pip install -q --no-index --no-deps --find-links .gpu-kit/wheels --target "$site")
if [ ${#missing[@]} -gt 0 ] && ! "$py" "${kit[@]}" "${missing[@]}"; then
    for pkg in "${missing[@]}"; do  # one at a time, to say which has no wheel for this Python
        "$py" "${kit[@]}" --upgrade "$pkg" || echo "could not install $pkg (no wheel for this Python in .gpu-kit/wheels)"
    done
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c 'import neuronabox.cli' || { echo "neuronabox does not import: stop"; exit 1; }

echo "== CUDA tests (tests/test_emu_backend.py -m gpu)"
timeout 240 "$py" -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_emu_backend.py --junitxml "$out/gpu-tests.xml"
tests=$?

echo "== nbox whatif: BERT-large with injected all-reduce delays, benchmarks/gpu_whatif.py ($((SECONDS - started)) s so far)"
# GPU_WHATIF_ARGS: extra arguments, e.g. "--tiny --steps 3" for a dry run of this script on a CPU.
# shellcheck disable=SC2086  # word splitting of it is the point
timeout 420 "$py" benchmarks/gpu_whatif.py --out "$out/gpu_whatif" ${GPU_WHATIF_ARGS:-}
sweep=$?

echo "== done in $((SECONDS - started)) s: tests exit $tests, sweep exit $sweep"
rm -rf "$site"
exit $(( tests || sweep ))
