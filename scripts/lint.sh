#!/usr/bin/env bash
# Lint: ruff (format + check), yamllint for configs, codespell, shellcheck, hadolint. Needs ./setup.sh --dev.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
.venv/bin/ruff format --check maxtext_moe tests
.venv/bin/ruff check maxtext_moe tests
.venv/bin/yamllint -d '{extends: default, rules: {line-length: {max: 120}, document-start: disable, comments: {min-spaces-from-content: 1}}}' configs
.venv/bin/codespell maxtext_moe tests configs docs README.md
.venv/bin/shellcheck setup.sh .ci/run scripts/*.sh scripts/slurm/*.sbatch docker/*.sh
.venv/bin/hadolint docker/Dockerfile docker/standin/Containerfile
