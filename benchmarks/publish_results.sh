#!/usr/bin/env bash
# Commit raw GPU runs to the orphan `results` branch, outside main's tree.
#
#   bash benchmarks/publish_results.sh RUN_DIR [RUN_DIR ...]
#
# Each RUN_DIR is a folder of this repository's working tree (a packed run,
# benchmarks/results/<session>/<run>); it is committed to the branch at the same path, replacing
# what the branch held there, in one commit on top of the branch (the branch's first commit when
# it does not exist yet). The commit is built in a temporary index with `git commit-tree`:
# main's index, HEAD and working tree are left as they were. OPPROF_RESULTS_BRANCH names another
# branch. Then `git push origin results`; docs/results.md says how to read the branch.
set -euo pipefail
if [ $# -eq 0 ]; then
  echo "usage: bash benchmarks/publish_results.sh RUN_DIR [RUN_DIR ...]" >&2
  exit 2
fi
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
branch=${OPPROF_RESULTS_BRANCH:-results}
rels=()
for dir in "$@"; do
  if [ ! -d "$dir" ]; then
    echo "$dir: not a folder; pass a packed run (benchmarks/results/<session>/<run>)" >&2
    exit 2
  fi
  abs=$(cd "$dir" && pwd -P)
  case "$abs/" in
    "$root"/?*/) rels+=("${abs#"$root"/}") ;;
    *)
      echo "$dir: not inside $root; the branch keeps a run at its path in the repository" >&2
      exit 2
      ;;
  esac
done

GIT_INDEX_FILE=$(mktemp)
export GIT_INDEX_FILE
list=$(mktemp)
trap 'rm -f "$GIT_INDEX_FILE" "$list"' EXIT
cd "$root"
if old=$(git rev-parse -q --verify "refs/heads/$branch"); then
  git read-tree "$old"
  parent=(-p "$old")
else
  old=""
  git read-tree --empty
  parent=()
fi
for rel in "${rels[@]}"; do
  git ls-files -z -- "$rel" | git update-index -z --force-remove --stdin
  : > "$list"
  while IFS= read -r -d '' f; do
    case "$f" in *$'\n'* | *$'\t'*) echo "skipped (a tab or newline in its name): $f" >&2; continue ;; esac
    printf '%s\n' "$f" >> "$list"
  done < <(find "$rel" -type f -print0 | sort -z)
  [ -s "$list" ] || { echo "$rel: no files" >&2; exit 2; }
  # One blob per file, then one index line per file: "mode blob<TAB>path".
  git hash-object -w --stdin-paths < "$list" \
    | paste - "$list" \
    | while IFS=$'\t' read -r blob path; do
        mode=100644
        [ -x "$path" ] && mode=100755
        printf '%s %s\t%s\n' "$mode" "$blob" "$path"
      done \
    | git update-index --add --index-info
done
tree=$(git write-tree)
if [ -n "$old" ] && [ "$tree" = "$(git rev-parse "$old^{tree}")" ]; then
  echo "$branch already holds ${rels[*]} as they are"
  exit 0
fi
message="Publish ${rels[*]}

Raw files of GPU runs packed on main at $(git rev-parse --short HEAD) (benchmarks/publish_results.sh)."
commit=$(git commit-tree "$tree" "${parent[@]}" -m "$message")
git update-ref -m "publish_results.sh" "refs/heads/$branch" "$commit" "$old"
echo "$branch: $commit holds ${rels[*]}; push with: git push origin $branch"
