"""CacheReforge offline: sensitivity calibration (``calibration``), trajectory fits and exact
policy replay (``trajectory``), hybrid executions, tail influence and certificates
(``analysis``), the LoRA update workload (``workload``) and ``kvmemory calibrate`` (``cli``).
The runtime they calibrate is :mod:`kvmemory.reforge`."""
