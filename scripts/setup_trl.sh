#!/usr/bin/env bash
# Makes .venv-trl: TRL 1.16 (the peer baseline of bench/vs_trl.py) with PEFT 0.21 (TRL's LoRA, and
# the reader tests/test_lora.py checks our saved adapters with) in an environment of its own,
# pinned to this project's torch (constraints/cpu.txt). Neither is a dependency of stream-rlhf;
# bench/trl_grpo.py runs there and imports only stream_rlhf.data.arithmetic from this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-trl
.venv-trl/bin/pip install -q -c constraints/cpu.txt torch trl==1.16.0 peft==0.21.0
.venv-trl/bin/python -c "import peft, trl; print('TRL', trl.__version__, 'and PEFT', peft.__version__, 'in .venv-trl')"
