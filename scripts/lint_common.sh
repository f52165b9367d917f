# Sourced by scripts/lint.sh and scripts/format.sh: finds the pinned tools and lists the
# files they look at. Not run on its own.
#
# RUFF and CLANG_FORMAT name the executables (default: the ones on PATH). Versions must be
# those of scripts/lint-requirements.txt:
#   python3 -m pip install -r scripts/lint-requirements.txt

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

RUFF="${RUFF:-ruff}"
CLANG_FORMAT="${CLANG_FORMAT:-clang-format}"

# The version pinned for a tool in lint-requirements.txt.
pinned_version() {
  sed -n "s/^$1==\([^[:space:]]*\).*/\1/p" scripts/lint-requirements.txt
}

# Fails unless `$1 --version` names the pinned version of package $2.
require_pinned() {
  local exe="$1" package="$2" want have
  want="$(pinned_version "$package")"
  if ! have="$("$exe" --version 2>/dev/null)"; then
    echo "lint: $exe not found. Install the pinned tools:" >&2
    echo "    python3 -m pip install -r scripts/lint-requirements.txt" >&2
    exit 2
  fi
  # "ruff 0.17.5" / "clang-format version 23.1.3 (...)": the first x.y.z is the version.
  have="$(grep -o -m1 '[0-9][0-9]*\.[0-9][0-9]*\.[0-9][0-9]*' <<<"$have" | head -1)"
  if [ "$have" != "$want" ]; then
    echo "lint: $exe is $package $have, but scripts/lint-requirements.txt pins $want" \
         "(another version formats differently). Install the pinned tools:" >&2
    echo "    python3 -m pip install -r scripts/lint-requirements.txt" >&2
    exit 2
  fi
}

# Tracked files, NUL-separated: C++ of csrc/ (clang-format) and Python (ruff).
cxx_files() { git ls-files -z -- 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh'; }
python_files() { git ls-files -z -- '*.py'; }
