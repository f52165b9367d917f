#!/usr/bin/env bash
# The style checks CI runs (.ci/run): ruff's lint rules and formatting (pyproject.toml),
# clang-format over csrc/ (.clang-format), no trailing whitespace or missing final
# newline in text files, and a working tree small enough for the GPU machines' copy.
# Files: the tracked ones and new ones git does not ignore. Changes nothing; fails on any
# finding, after running every check. scripts/format.sh fixes most.
#
#   bash scripts/lint.sh
#
# Uses the versions pinned in scripts/lint-requirements.txt (RUFF / CLANG_FORMAT name them
# if they are not on PATH).
set -uo pipefail
source "$(dirname "$0")/lint_common.sh"

require_pinned "$RUFF" ruff
require_pinned "$CLANG_FORMAT" clang-format

failed=()

# .pre-commit-config.yaml installs its own copies of the tools: the same versions.
while IFS= read -r pin; do
  if ! grep -qF "\"$pin\"" .pre-commit-config.yaml; then
    echo "lint: .pre-commit-config.yaml does not pin $pin (scripts/lint-requirements.txt does)" >&2
    failed+=("pre-commit pins")
  fi
done < <(grep -E '^[A-Za-z0-9_.-]+==' scripts/lint-requirements.txt)

echo "lint: ruff check"
python_files | xargs -0 "$RUFF" check --no-fix -- || failed+=("ruff check")

echo "lint: ruff format --check"
python_files | xargs -0 "$RUFF" format --check -- || failed+=("ruff format")

echo "lint: clang-format"
cxx_files | xargs -0 "$CLANG_FORMAT" --dry-run -Werror -- || failed+=("clang-format")

# Recorded benchmark output (benchmarks/results/) is kept byte for byte as it was written.
echo "lint: whitespace"
text_files() {
  repo_files . ':!benchmarks/results/' | xargs -0 grep -IlZ '' -- 2>/dev/null
}
if text_files | xargs -0 grep -n -E '[[:space:]]+$' --; then
  echo "lint: trailing whitespace on the lines above" >&2
  failed+=("whitespace")
fi
while IFS= read -r -d '' file; do
  if [ -s "$file" ] && [ -n "$(tail -c1 -- "$file")" ]; then
    echo "$file: no newline at the end of the file" >&2
    failed+=("final newline")
  fi
done < <(text_files)

# The GPU machines get a copy of this working tree (the device tool: tracked files and new
# ones git does not ignore), at most 64 MiB of it; a call over that is refused before it runs.
# benchmarks/results/ grows every session: session 59 found the tree at 63 MiB and archived a
# month of it (benchmarks/results/README.md). 8 MiB stay free for a session's new results and
# the call scripts it carries. Bytes counted by reading the files (wc -c: an integer however
# large, and no stat flags that differ between systems); a tracked file deleted in the work
# tree counts nothing.
echo "lint: tree size"
tree_limit_mib=56
tree_bytes=$(repo_files . | xargs -0 cat -- 2>/dev/null | wc -c | tr -d '[:space:]')
if [ "$tree_bytes" -gt $(( tree_limit_mib << 20 )) ]; then
  echo "lint: the working tree holds $(( (tree_bytes + (1 << 20) - 1) >> 20 )) MiB (over" \
       "$tree_limit_mib MiB): a device call copies it and refuses more than 64 MiB. Archive" \
       "the oldest results as benchmarks/results/README.md says." >&2
  failed+=("tree size")
fi

if [ "${#failed[@]}" -ne 0 ]; then
  echo "lint: FAILED: ${failed[*]}. bash scripts/format.sh fixes formatting and most ruff" \
       "findings; the rest need an edit." >&2
  exit 1
fi
echo "lint: all checks passed"
