"""The GPU benchmark behind `bench/gpu.py` (benchmark code: the `hmc` package never imports it).

    harness     devices, environment, workloads, data pattern, byte checks, timers
    kernel      a CuPy copy kernel, one thread block per range: the ceiling
    baselines   torch copies (device, peer, pinned), the copy kernel, CUDA IPC, NCCL; the probe
    nixl        NIXL 1.5.x (UCX defaults, and UCX_TLS=tcp,cuda_copy) in two processes
    hmc_rows    HMC's paths through its public API: ipc, staged (peer declared AMD), staged-tcp
    checks      the issues' ratio checks, the floors and the table
    run         one run over all of them, in child processes, with bounded waits

bench/ is not a package: bench/gpu.py runs with bench/ first on sys.path (a script's
folder), so this folder imports as `_gpu`, and spawned children inherit that path.
"""
