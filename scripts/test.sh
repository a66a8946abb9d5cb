#!/usr/bin/env bash
# Run the test suite (sets up .venv on first run). Extra args go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
# pytest only applies pyproject's testpaths when invoked from the repo root.
cd "$OVERLORD_ROOT"
exec python -m pytest "$@"
