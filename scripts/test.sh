#!/usr/bin/env bash
# Every check and test of the repository: formatting, lints (with and without default
# features), the Rust tests, the Python package's type hints (mypy), then the Python package —
# built and installed with pip (maturin) into a private virtual environment, target/pyenv, made
# on first use — and its pytest suite, which runs real multi-process torch.distributed jobs
# (gloo, CPU).
#
# `--full` runs pytest's heavy sweep too (the tests marked `full`: more dtypes, worlds, model
# families and planted bugs of the cases the quick slice runs once; about 1.6 times the time).
#
# Needs a Rust toolchain and python3 (with venv); everything else comes from crates.io and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

pytest_args=()
for arg in "$@"; do
  case "$arg" in
    --full) pytest_args+=(--full) ;;
    *) echo "test.sh: unknown argument $arg (only --full)" >&2; exit 2 ;;
  esac
done

venv=target/pyenv
py="$venv/bin/python"
packages=(numpy pytest mypy safetensors ml_dtypes "maturin>=1.7,<2" "torch==2.15.0" "megatron-core==0.16.1"
          "transformers==5.23.0" "accelerate==1.15.0")
if ! "$py" -c "import numpy, pytest, mypy, safetensors, ml_dtypes, maturin, torch, megatron.core, transformers, accelerate" 2>/dev/null; then
  echo "test.sh: making the Python environment $venv (torch is large: the first run downloads it)"
  python3 -m venv "$venv"
  "$py" -m pip install --quiet --disable-pip-version-check "${packages[@]}"
fi
# megatron-core 0.19.2 beside 0.16.1, for the real-engine tests that run both (TTRACE_TEST_MCORE=19
# puts it first on the jobs' path). Its metadata asks for Python 3.12 but it publishes a CPython
# 3.11 wheel, which imports and runs here.
if [ ! -d target/mcore19/megatron/core ]; then
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps --ignore-requires-python \
    --target target/mcore19 "megatron-core==0.19.2"
fi
# torchtitan 0.3.0 (its MoE under its own expert parallelism, python/tests/titan_moe.py) and
# the few packages its model code imports, beside the environment (TTRACE_TEST job titan_moe
# puts it first on its path): its other requirements (datasets, wandb, ...) serve its trainer.
if [ ! -d target/titan030/torchtitan ]; then
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps --target target/titan030 \
    "torchtitan==0.3.0" "spmd_types==0.2.3" "tyro==1.0.17" "typeguard==4.6.0" "einops==0.8.2" \
    "docstring_parser==0.18.0"
fi
export PATH="$PWD/$venv/bin:$PATH"
# One build from scratch: incremental compilation's caches would only take disk (gigabytes).
export CARGO_INCREMENTAL=0

cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy --lib --no-default-features -- -D warnings
cargo test

# The package's type hints hold (the extension module through its stubs).
"$py" -m mypy --ignore-missing-imports python/ttrace

# The package as a user installs it (pip builds the wheel with maturin).
"$py" -m pip install --quiet --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps .
"$py" -m pytest -q -p no:cacheprovider python/tests ${pytest_args[@]+"${pytest_args[@]}"}
