# shellcheck shell=bash
# Sourced by scripts/demo.sh and scripts/test.sh (not meant to be run directly).
# Creates/refreshes the repo-local virtual env .venv and puts it first on PATH.
set -euo pipefail

OVERLORD_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export OVERLORD_ROOT

_overlord_venv="$OVERLORD_ROOT/.venv"
_overlord_stamp="$_overlord_venv/.overlord-installed"

if [ ! -x "$_overlord_venv/bin/python" ] \
    || [ ! -f "$_overlord_stamp" ] \
    || [ "$OVERLORD_ROOT/pyproject.toml" -nt "$_overlord_stamp" ]; then
    echo "setting up .venv (first run only)..." >&2

    if [ ! -x "$_overlord_venv/bin/python" ]; then
        if command -v python3.11 >/dev/null 2>&1; then
            _overlord_py=python3.11
        elif command -v python3 >/dev/null 2>&1; then
            _overlord_py=python3
        else
            echo "error: neither python3.11 nor python3 found on PATH; Python >= 3.11 is required" >&2
            exit 1
        fi
        if ! "$_overlord_py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
            echo "error: $_overlord_py is Python $("$_overlord_py" -c 'import platform; print(platform.python_version())'); torchdata-overlord needs Python >= 3.11" >&2
            exit 1
        fi
        "$_overlord_py" -m venv "$_overlord_venv"
    fi

    if ! "$_overlord_venv/bin/python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
        echo "error: $_overlord_venv uses Python < 3.11; delete .venv and retry with Python >= 3.11" >&2
        exit 1
    fi

    "$_overlord_venv/bin/python" -m pip install --quiet --upgrade pip
    # torch/torchvision first and pinned, so the editable install never re-resolves them.
    "$_overlord_venv/bin/python" -m pip install "torch==2.14.1" "torchvision==0.29.1"
    (cd "$OVERLORD_ROOT" && "$_overlord_venv/bin/python" -m pip install -e ".[test]")
    touch "$_overlord_stamp"
fi

export VIRTUAL_ENV="$_overlord_venv"
export PATH="$_overlord_venv/bin:$PATH"
hash -r
