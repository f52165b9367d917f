# Sourced by scripts/lint.sh and scripts/format.sh: finds the pinned tools and lists the
# files they look at. Not run on its own.
#
# RUFF and CLANG_FORMAT name the executables; by default, those that
#   python3 -m pip install -r scripts/lint-requirements.txt
# put beside python3's scripts (found there even when that directory is not on PATH, as
# under pyenv before a rehash), else those on PATH. Versions must be the pinned ones.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

python_scripts_dir="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))' \
                      2>/dev/null || true)"
# The tool pip installed for python3, or the one on PATH.
tool_path() {
  if [ -n "$python_scripts_dir" ] && [ -x "$python_scripts_dir/$1" ]; then
    echo "$python_scripts_dir/$1"
  else
    echo "$1"
  fi
}
RUFF="${RUFF:-$(tool_path ruff)}"
CLANG_FORMAT="${CLANG_FORMAT:-$(tool_path clang-format)}"

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
  have="${have:-of unknown version}"
  if [ "$have" != "$want" ]; then
    echo "lint: $exe is $package $have, but scripts/lint-requirements.txt pins $want" \
         "(another version formats differently). Install the pinned tools:" >&2
    echo "    python3 -m pip install -r scripts/lint-requirements.txt" >&2
    exit 2
  fi
}

# The files a commit could hold, NUL-separated: tracked ones and new ones git does not
# ignore (a new file is checked before its first commit, not after it reached CI).
repo_files() { git ls-files -z --cached --others --exclude-standard -- "$@"; }
# C++ of csrc/ (clang-format) and Python (ruff).
cxx_files() { repo_files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh'; }
python_files() { repo_files '*.py'; }
