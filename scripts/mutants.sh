#!/usr/bin/env bash
# Mutation testing of the core files: does a unit test fail when the code is changed?
#
# Runs cargo-mutants (v27) with the unit tests only (`-C --lib`, one job) on the core files,
# or on the files given, then prints caught / missed / unviable / timeout per file. Missed
# mutants listed in scripts/mutants-equivalent.txt (changes nothing observable, one line each
# with why) are shown apart, so a new miss stands out; the exit status is 1 when there is one.
# A timeout is a mutant under which a test hangs instead of failing: counted apart, not missed.
#
# Slow: a mutant costs an incremental build (30-60 s on 2 cores), the core files about 600
# mutants. Not for CI: run it on the files you changed, e.g.
#   scripts/mutants.sh src/ingress/reorder.rs
#   scripts/mutants.sh --in-place src/lease/manager.rs   # no copy of the tree: don't edit meanwhile
#   scripts/mutants.sh --report mutants.out src/scheduler/state.rs   # re-read an earlier run only
#
# Arguments ending in .rs are the files; the others go to cargo mutants (e.g. --in-place,
# -F REGEX, --baseline=skip). CARGO_TARGET_DIR is honoured as cargo does.
set -euo pipefail

cd "$(dirname "$0")/.."
EQUIVALENT=scripts/mutants-equivalent.txt
CORE_FILES=(
  src/lease/manager.rs
  src/lease/clock.rs
  src/lease/key.rs
  src/lease/reaper.rs
  src/load.rs
  src/routing.rs
  src/scheduler/mod.rs
  src/scheduler/state.rs
  src/ingress/sequence.rs
  src/ingress/reorder.rs
  src/ingress/apply.rs
  src/prefix/hash.rs
  src/prefix/index.rs
  src/wire/mod.rs
  src/wire/reader.rs
  src/wire/raw.rs
  src/wire/plain.rs
  src/wire/full.rs
  src/wire/batch.rs
)

out=mutants.out
args=()
files=()
report_only=
while (($#)); do
  case "$1" in
    --report) report_only=1; out=${2:?--report needs the output directory}; shift 2 ;;
    *.rs) files+=("$1"); shift ;;
    *) args+=("$1"); shift ;;
  esac
done
((${#files[@]})) || files=("${CORE_FILES[@]}")

if [[ -z $report_only ]]; then
  file_args=()
  for f in "${files[@]}"; do file_args+=(--file "$f"); done
  # Exit 2: some mutant missed, 3: some timed out; the report below says which. Any other
  # failure (bad arguments, unmutated tests failing) stops here.
  rc=0
  cargo mutants --cargo-arg=--lib --output . "${file_args[@]}" "${args[@]}" || rc=$?
  case $rc in 0 | 2 | 3) ;; *) echo "cargo mutants failed (exit $rc)" >&2; exit "$rc" ;; esac
fi

[[ -d $out ]] || { echo "no $out: cargo mutants did not run" >&2; exit 2; }

# "src/x.rs:LINE:COL: replace A with B in F" -> "src/x.rs: replace A with B in F": equivalents
# are named without line and column, which move with every edit above them.
strip() { sed -E 's/^([^:]+):[0-9]+:[0-9]+:/\1:/' "$@" 2>/dev/null || true; }
listed() { grep -vE '^\s*(#|$)' "$EQUIVALENT" | sed -E 's/\s+#.*$//' | sort -u; }

printf '%-28s %7s %7s %11s %9s %8s\n' file caught missed equivalent unviable timeout
for f in "${files[@]}"; do
  count() { grep -c "^$f:" "$out/$1" 2>/dev/null || true; }
  missed=$(strip "$out/missed.txt" | grep "^$f:" | sort -u || true)
  equivalent=$(comm -12 <(printf '%s\n' "$missed" | sed '/^$/d') <(listed) | wc -l)
  printf '%-28s %7s %7s %11s %9s %8s\n' "$f" "$(count caught.txt)" \
    "$(($(count missed.txt) - equivalent))" "$equivalent" "$(count unviable.txt)" "$(count timeout.txt)"
done

new=$(comm -23 <(strip "$out/missed.txt" | sort -u) <(listed))
stale=$(comm -13 <(strip "$out/missed.txt" | sort -u) <(listed) |
  grep -F -f <(printf '%s:\n' "${files[@]}") || true)
if [[ -n $stale ]]; then
  echo
  echo "Listed as equivalent but not missed in this run (caught now, gone, or not run):"
  printf '  %s\n' "$stale"
fi
if [[ -n $new ]]; then
  echo
  echo "NEW MISSES: no unit test fails under these changes (write one, or list the mutant in"
  echo "$EQUIVALENT with why it changes nothing observable):"
  printf '%s\n' "$new" | sed 's/^/  /'
  exit 1
fi
echo
echo "No new misses: every missed mutant is a listed equivalent."
