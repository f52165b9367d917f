#!/usr/bin/env bash
# Rewrites the sources (tracked, and new ones git does not ignore) into the project's style:
# ruff's safe fixes (imports sorted, pyupgrade, ... as configured in pyproject.toml), ruff
# format, then clang-format (.clang-format) over csrc/. Afterwards scripts/lint.sh passes
# unless a finding needs a person (ruff lists it: a too-long string or comment, an ambiguous
# name, ...).
#
#   bash scripts/format.sh
#
# Uses the versions pinned in scripts/lint-requirements.txt (RUFF / CLANG_FORMAT name them
# if they are not on PATH).
set -euo pipefail
source "$(dirname "$0")/lint_common.sh"

require_pinned "$RUFF" ruff
require_pinned "$CLANG_FORMAT" clang-format

# Fixes first (they may leave code the formatter reflows), then the formatter.
python_files | xargs -0 "$RUFF" check --fix --exit-zero --silent --
python_files | xargs -0 "$RUFF" format --quiet --
cxx_files | xargs -0 "$CLANG_FORMAT" -i --
echo "format: done; now run: bash scripts/lint.sh"
