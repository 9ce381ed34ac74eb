#!/usr/bin/env bash
# The commands whose files and consoles a refactoring must leave byte-identical (issue #49), run into one
# folder so that two checkouts can be compared:
#
#   bash benchmarks/same_outputs.sh /tmp/before        # on the commit before the change
#   bash benchmarks/same_outputs.sh /tmp/after         # on the commit after it
#   diff -r /tmp/before /tmp/after                     # times and dates are masked, nothing else
#
# Runs offline on a CPU in about ten minutes (2 cores). Uses the `mpsimpact` on PATH, or
# MPSIMPACT=/path/to/venv/bin/mpsimpact (or "python -m mpsimpact") with PYTHONPATH pointing at a worktree's src/.
set -u
out=${1:?usage: same_outputs.sh OUT_DIR}
here=$(cd "$(dirname "$0")/.." && pwd)
mps=${MPSIMPACT:-mpsimpact}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 COLUMNS=80 NO_COLOR=1 TERM=dumb
rm -rf "$out" && mkdir -p "$out"

one() {  # one NAME ARGS...: stdout and the exit code into NAME.txt, stderr into NAME.err, files into NAME/
    local name=$1; shift
    (cd "$out" && $mps "$@" >"$name.txt" 2>"$name.err"; echo "exit $?" >>"$name.txt")
}
one run-quick          run sentiment --quick --out run-quick
one run-finetune-quick run finetune --quick --out run-finetune-quick
one run-retrieval      run retrieval --quick --out run-retrieval
one plan-versions      plan sentiment --versions --out plan-versions
one check-llama        check "$here/tests/data/llama-style-32k/config.json" --json
one check-llama-text   check "$here/tests/data/llama-style-32k/config.json"
one check-bert         check "$here/tests/data/bert-base/config.json" --batch-size 2048 --torch-profile 2.12.1
one check-t5           check "$here/tests/data/t5-base/config.json"
one sweep-emulated     sweep --device cpu --emulate --index-bits 20 --quick --max-memory 16GiB --out sweep-emulated

# times, dates, durations, free memory and the figures' pixels differ from run to run; nothing else may. A
# figure is kept as its name (figures.txt); a console's table as its words (a column narrows with a time).
find "$out" -name '*.png' | sed "s|^$out/||" | sort >"$out/figures.txt"
find "$out" -name '*.png' -delete
find "$out" -type f \( -name '*.txt' -o -name '*.json' -o -name '*.md' -o -name '*.csv' -o -name '*.html' -o -name '*.jsonl' \) -print0 |
    xargs -0 sed -i -E \
        -e 's/data:image\/png;base64,[A-Za-z0-9+\/=]+/<png>/g' \
        -e 's/[0-9]{8}-[0-9]{6}/<stamp>/g' \
        -e 's/[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9:.+-]+Z?/<time>/g' \
        -e 's/[0-9]+(\.[0-9]+)? ?(s|ms|min|seconds)\b/<dur>/g' \
        -e 's/"(elapsed|seconds|wall_s|wall|started|finished|duration|host_memory_available|max_memory)[a-z_]*": [0-9.e+-]+/"\1": <n>/g' \
        -e 's/(<td>|\| )[0-9]+\.[0-9]{4}( \||<\/td><\/tr>)/\1<wall>\2/g'
find "$out" -name '*.txt' -print0 | xargs -0 sed -i -E -e 's/[─━]+/-/g' -e 's/ +/ /g'
# progress lines (stderr, "k/n") are sampled by the clock: their count and places vary; the rest of stderr may not
find "$out" -name '*.err' -print0 | xargs -0 sed -i -E -e '/[0-9]+\/[0-9]+/d' -e '/elapsed|left$/d'
find "$out" -name 'sweep*.txt' -print0 | xargs -0 sed -i -E -e '/^\[[0-9]+\/[0-9]+\]/d' -e '/elapsed|left$/d'
echo "written: $out"
