"""The kvmemory lab: the ``kvmemory`` command line (``demo``, ``bench``, ``calibrate``),
benchmarks, repair-fidelity evaluation, edit fuzzing with its invariants, crash and
concurrency harnesses, and CacheReforge's offline calibration.

None of it is imported by the runtime packages (``kvmemory``, ``langchain_kvmemory``); it is
installed beside them by ``make setup`` or ``pip install ./lab``.
"""
