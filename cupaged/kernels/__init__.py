"""The kernels of ``cuda/`` from Python: what each launch needs, how it is built and loaded.

Private to cupaged; :mod:`cupaged.attention` and :mod:`cupaged.cache` call it.

==================  ======================================================================
``target``          the GPU a launch is planned for: limits, the one occupancy calculator
``launch_decode``   decode's thread-block layout, shared memory, instantiation names, planner
``launch_prefill``  prefill's tiles, shared memory, split-K plan, instantiation names
``launch_copies``   the KV write's and the block copy's instantiations, grids and blocks
``launch_checks``   the table checks' instantiation, grid and block
``args``            each kernel's arguments as a named record, held against ``cuda/*.cu``
``prefill_work``    a prefill batch's query tiles, for the split-K plan
``loader``          CuPy ``RawModule`` (NVRTC) on the GPU, the CPU backend for NumPy arrays
``headers``         where the CUDA headers are, for NVRTC, the CPU backend and the scripts
``cpu``             the CPU backend: the same ``cuda/*.cu`` built by the host compiler
==================  ======================================================================
"""
