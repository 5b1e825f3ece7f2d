# Sourced by .ci/megatron-matrix and .ci/megatron-lm-tests: megatron_venv <version> makes (when
# missing) and prints the venv of one megatron-core release, or of Megatron-LM main built from the
# mirror's source tree: ${TOKENMILL_MATRIX_VENVS:-/work/venvs}/mcore-<version>.
megatron_mirror="${TOKENMILL_MEGATRON_MIRROR:-/work/.mirror/NVIDIA+Megatron-LM/repo}"

megatron_branch() {  # the Megatron-LM ref a version's tests and training code come from
  # the release's own tag when the mirror has it (core_r0.17.0 is already past 0.17.1, and its
  # megatron/training imports modules the 0.17.0 wheel lacks), else the release branch
  case "$1" in
    main) echo main ;;
    *) if git --git-dir="$megatron_mirror" rev-parse -q --verify "refs/tags/core_v$1" >/dev/null; then
         echo "core_v$1"
       else
         echo "core_r$(echo "$1" | cut -d. -f1-2).0"
       fi ;;
  esac
}

megatron_venv() {
  local version="$1" venv
  venv="${TOKENMILL_MATRIX_VENVS:-/work/venvs}/mcore-$version"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install -q torch==2.13.0 >&2
    "$venv/bin/pip" install -q numpy "pytest>=8" "hypothesis>=6.100" tqdm >&2
    case "$version" in
      0.16.*) "$venv/bin/pip" install -q "megatron-core==$version" >&2 ;;
      main)
        # Megatron-LM main from source (its pyproject declares Python >= 3.12; the data code runs
        # on 3.11); the build compiles megatron's helpers
        local src
        src="$(mktemp -d)"
        git --git-dir="$megatron_mirror" archive main pyproject.toml setup.py README.md \
          MANIFEST.in megatron/core megatron/training | tar -x -C "$src"
        "$venv/bin/pip" install -q triton >&2
        "$venv/bin/pip" install -q --no-deps --ignore-requires-python "$src" >&2
        rm -rf "$src" ;;
      # 0.17+ declare Python >= 3.12; their dataset modules run on 3.11
      *) "$venv/bin/pip" install -q --no-deps --ignore-requires-python "megatron-core==$version" >&2
         "$venv/bin/pip" install -q triton >&2 ;;
    esac
  fi
  echo "$venv"
}
