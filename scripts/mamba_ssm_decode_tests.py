"""Run mamba_ssm's own decode tests against autossd's decode step, on a GPU.

usage: python scripts/mamba_ssm_decode_tests.py [--help] TEST_FILE [pytest options...]

TEST_FILE is mamba_ssm's tests/ops/triton/test_selective_state_update.py (from its repository: the
wheel holds no tests). mamba_ssm must be importable (installed, or on PYTHONPATH): the test file
takes its float32 reference, selective_state_update_ref, from it. Before pytest imports the test
file, this script puts autossd.selective_state_update in the place of mamba_ssm's function
(mamba_ssm.ops.triton.selective_state_update.selective_state_update), so every test calls
autossd's and compares it with mamba_ssm's reference at the file's own tolerances. mamba_ssm's
package __init__, which needs its CUDA extensions, is bypassed (autossd.peer). Exit status:
pytest's. Options after TEST_FILE go to pytest (e.g. -x, -k mamba, -n 4 with pytest-xdist).

Example, on a GPU machine with mamba_ssm under /tmp/site:
    PYTHONPATH=$PWD:/tmp/site python scripts/mamba_ssm_decode_tests.py \\
        scratch/test_selective_state_update.py -q
"""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    import torch
    if not torch.cuda.is_available():
        print("no GPU: mamba_ssm's decode tests run on cuda")
        return 2
    import pytest

    import autossd
    from autossd.peer import load_mamba_ssm

    if load_mamba_ssm("selective_state_update", "selective_state_update_ref") is None:
        print("mamba_ssm is not importable: install it or put it on PYTHONPATH")
        return 2
    sys.modules["mamba_ssm.ops.triton.selective_state_update"].selective_state_update = \
        autossd.selective_state_update

    class OnlyAutossd:
        """Refuses to run when a collected test module would call anything but autossd's."""

        @staticmethod
        def pytest_collection_modifyitems(items):
            for item in items:
                fn = getattr(item.module, "selective_state_update", None)
                if fn is not autossd.selective_state_update:
                    raise pytest.UsageError(f"{item.nodeid}: selective_state_update is {fn!r}, not autossd's")

    return int(pytest.main([argv[0], "-p", "no:cacheprovider", *argv[1:]], plugins=[OnlyAutossd()]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
