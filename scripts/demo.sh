#!/usr/bin/env bash
# Run the end-to-end demo (sets up .venv on first run).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec python -m torchdata_overlord.demo "$@"
