#!/usr/bin/env bash
# The device tool carries the working tree's tracked files and the carry paths, 64 MiB in all. With the devkit bundle
# (site 37 MB, DeepGEMM, the JIT cache) the whole tree went over it in session 74 (66.5 MB). No step of gpu_check.sh
# and no test module's import reads the two result folders below, so a call can go without them:
#   scripts/device_slim.sh out    # before the calls: takes them out of the working tree (they stay in git)
#   scripts/device_slim.sh back   # after: restores them from git
set -euo pipefail
FOLDERS=(benchmark/results/eplb benchmark/results/mla_decode)
tree_mb() { git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {printf "%.1f", s / 1e6}'; }
case "${1:-}" in
  out)
    if [ -n "$(git status --porcelain -- "${FOLDERS[@]}")" ]; then
      echo "device_slim: uncommitted changes under ${FOLDERS[*]}: commit them first (nothing removed)" >&2
      exit 2
    fi
    rm -rf "${FOLDERS[@]}"
    echo "device_slim: ${FOLDERS[*]} out of the working tree (tracked files now $(tree_mb) MB); 'back' restores them" ;;
  back)
    git ls-files -z --deleted -- "${FOLDERS[@]}" | xargs -0 -r git checkout --  # only what is missing: no edit lost
    echo "device_slim: ${FOLDERS[*]} restored (tracked files $(tree_mb) MB)" ;;
  *)
    echo "usage: scripts/device_slim.sh out|back" >&2
    exit 2 ;;
esac
