"""CI: checks the report of `mpsimpact run sentiment --batch-size 1400` (crosses the boundary at 1365)."""

import json
import sys
from pathlib import Path

report = json.loads((Path(sys.argv[1]) / "report.json").read_text())
off, stop, chunk = report["conditions"]
# P of 1400 texts at 512 tokens crosses 2**32: divmod(2**32 // 512**2, 12) = (1365, 4) -> 35 texts.
expected = {
    "off": (off["status"], off["corrupted_count"], off["first_corrupted_index"], off["predicted_first_corrupted_index"]),
    "raise": (stop["status"], stop["wrong_values_before_stop"]),
    "chunk": (chunk["status"], chunk["corrupted_count"]),
}
assert expected == {"off": ("completed", 35, 1365, 1365), "raise": ("stopped_by_guard", 0), "chunk": ("completed", 0)}, expected
assert report["geometry"]["emulated"] and "EMULATED" in (Path(sys.argv[1]) / "report.md").read_text()
assert report["release"]["judged"] == "2.14.0" and report["config"]["torch_profile"] is None, report["release"]
print(f"main command check passed: {expected}")
