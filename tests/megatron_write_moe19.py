"""By hand, not a test: megatron-core 0.19.2 (the /work/venv-mcore19 of fixtures/megatron/README.md, a CUDA build of
torch run on CPU ranks) loads MoE outputs of ``zckpt convert --to megatron --ep N`` with the suite's own worker
(tests/megatron_write_moe_worker.py through tests/megatron_write_worker.py), after ``cpu_shim.megatron_lm()``, which
that torch build needs before megatron is imported (fixtures/megatron/README.md, item 7). docs/megatron.md records
what it gave.

    zckpt convert fixtures/megatron/moe19_ep2_dp4 --to megatron --ep 1 -o /tmp/moe19-ep1
    echo '[{"source": "moe19_ep2_dp4", "ckpt": "/tmp/moe19-ep1", "shape": [1, 1, 2], "ep": 1, "etp": 1,
            "worker": "megatron_write_moe_worker"}]' > /tmp/jobs.json
    OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES= PYTHONPATH=. /work/venv-mcore19/bin/python -m torch.distributed.run \\
        --nproc-per-node 2 tests/megatron_write_moe19.py --jobs /tmp/jobs.json --result /tmp/result.json
"""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    sys.path[:0] = [str(ROOT / "fixtures" / "megatron"), str(ROOT / "tests"), str(ROOT)]
    import cpu_shim
    cpu_shim.megatron_lm()
    sys.argv = [str(ROOT / "tests" / "megatron_write_worker.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
