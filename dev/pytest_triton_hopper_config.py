"""A pytest plugin that runs the tests with one config of triton.flash's forward Hopper variant
in every entry of flash.HOPPER_TABLE and in flash.HOPPER_DEFAULT, to check a candidate config on
every feature before it enters the table:

    TRITON_HOPPER_CONFIG=128,64,8,3,0 ATTNKERN_TRITON_HOPPER=all PYTHONPATH=dev ATTNKERN_TEST_GPU=1 \\
        python3 -m pytest -p pytest_triton_hopper_config tests/test_triton.py -k "hopper_variant or table_configs"

(ATTNKERN_TRITON_HOPPER=all: every call that can take the variant takes it, at this config.)
The config is BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize (0/1), as the table's."""

import os


def pytest_configure(config):
    spec = os.environ.get("TRITON_HOPPER_CONFIG", "")
    if not spec:
        return
    from attnkern.backends.triton import flash

    bm, bn, warps, stages, ws = (int(x) for x in spec.split(","))
    forced = (bm, bn, warps, stages, bool(ws))
    for key in flash.HOPPER_TABLE:
        flash.HOPPER_TABLE[key] = forced
    flash.HOPPER_DEFAULT = forced
