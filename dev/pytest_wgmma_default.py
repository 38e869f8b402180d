"""A pytest plugin that runs the test suites with another default division of
flash_wgmma.cu (cpp.WGMMA_DEFAULT, and its cp.async form for the featured and float32-rows
kernels, cpp.WGMMA_OTHER), to check a candidate division on every feature before it becomes
the default:

    WGMMA_DEFAULT="64=wg2k128s3,128=wg2k128s2" PYTHONPATH=dev ATTNKERN_TEST_GPU=1 \\
        python3 -m pytest -p pytest_wgmma_default tests/test_cuda.py

Each entry is D=division, a division named as dev/gpu_flash_versions.py names them
(wg{warpgroups}k{keys}[s{stages}[p][e][t][P]], cpp.WgmmaConfig.parse)."""

import os


def pytest_configure(config):
    spec = os.environ.get("WGMMA_DEFAULT", "")
    if not spec:
        return
    from attnkern.backends.cuda import cpp

    for entry in spec.split(","):
        d, name = entry.split("=")
        division = cpp.WgmmaConfig.parse(name)
        division.check(int(d))
        cpp.WGMMA_DEFAULT[int(d)] = division
        cpp.WGMMA_OTHER[int(d)] = division.tma_off()  # the featured and float32-rows kernels' form of it


def pytest_report_header(config):
    spec = os.environ.get("WGMMA_DEFAULT", "")
    return f"flash_wgmma.cu default divisions: {spec}" if spec else None
