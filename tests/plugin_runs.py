"""What the pytest plugin's tests share: someone else's small suite (tests/data/their_suite, also the README's
example), the options that make its batches cross the scaled limits, and readers of a pytester run (each test's
outcome; the lines the plugin itself printed)."""

import re
from pathlib import Path

SUITE = (Path(__file__).parent / "data" / "their_suite" / "suite_theirs.py").read_text()
CROSSING = {"test_bmm_matches_per_sample", "test_matmul_matches_per_sample", "test_tiny_bert_batch_matches_each_sample",
            "test_sdpa_math_matches_per_sample"}
# At 12 bits (LIMIT 4096) the suite's batches cross the scaled limits as full-size runs cross MPS's.
NARROW = ["--mps-index-bits", "12", "--mps-profile", "2.14.0", "-p", "no:cacheprovider", "-p", "no:randomly"]


def import_what_runs_import() -> None:
    """pytester's in-process runs drop the modules a run imported; torch registers some of its libraries once per
    process, so what the suite and the plugin import is imported first (by a module fixture), and kept."""
    import hypothesis  # noqa: F401  # its pytest plugin imports it at every run's end: 1.7 s a run
    import torch.distributed._functional_collectives  # noqa: F401
    import transformers.models.bert.modeling_bert  # noqa: F401

    import mpsimpact.modes.emulator  # noqa: F401
    import mpsimpact.modes.guard  # noqa: F401
    import mpsimpact.output.files  # noqa: F401


def outcomes(recorder, when: str = "call") -> dict[str, str]:
    """{test name: outcome} of one phase from a pytester run's hook recorder."""
    reports = recorder.getreports("pytest_runtest_logreport")
    return {r.nodeid.split("::")[-1]: r.outcome for r in reports if r.when == when}


_SECTION = re.compile(r"^[=_-]{3,} (.*?) [=_-]{3,}$")


def plugin_lines(outlines: list[str]) -> list[str]:
    """The lines of a run's output that the plugin printed: its header lines (and their wrapped continuations),
    its summary section and each failed test's mpsimpact section, without pytest's own lines around them."""
    lines, inside, header = [], False, False
    for line in outlines:
        section = _SECTION.match(line)
        if section is not None:
            inside = section.group(1).startswith("mpsimpact: ")
            continue
        header = line.startswith("mpsimpact: ") or header and line.startswith("    ")
        if inside or header:
            lines.append(line)
    return lines
