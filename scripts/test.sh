#!/usr/bin/env bash
# Run the test suite (sets up .venv on first run). Extra args go to pytest.
# Two pytest-xdist workers by default (OVERLORD_TEST_WORKERS=N for another count, 0 for one process): most
# tests wait on role processes they start, so one pytest process left the second core mostly idle (2 cores:
# 14 min 48 s in one process, 9 min 0 s in two).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
# pytest only applies pyproject's testpaths when invoked from the repo root.
cd "$OVERLORD_ROOT"
exec python -m pytest -n "${OVERLORD_TEST_WORKERS:-2}" "$@"
