#!/usr/bin/env bash
# The CPU learning check: the tiny random-weight model on synthetic CLEVRER-like video QA.
# Writes runs/learning_check/metrics.jsonl and bench/learning_check.png (reward per step).
set -euo pipefail
cd "$(dirname "$0")/.."
rollplex run specs/learning_check_tiny.yaml --out runs/learning_check --quiet
python bench/plot_metrics.py runs/learning_check/metrics.jsonl bench/learning_check.png
