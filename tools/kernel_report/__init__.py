"""Static performance report of cupaged's kernels, without a GPU.

For the instantiations that the launch tables (``cupaged/kernels/launch_*.py``) pick on each
architecture (sm_75, sm_80, sm_90: the kernel that compiles and fits there, a large GQA group cut
into chunks), compiled by NVRTC for it (real cubins, no driver needed):

- registers, spill bytes, static shared memory: ptxas's ``-v`` lines in the NVRTC log;
- dynamic shared memory: the launch table;
- theoretical occupancy (CTAs and warps per SM) on T4 / A100 / H100 / H200: the limits and the
  occupancy calculator of ``cupaged/kernels/target.py`` (``SM_LIMITS``, ``GPUS``, ``occupancy``);
- the widths of global and shared loads and stores in the SASS (``nvdisasm``), counted in the
  innermost loops (a loop is a backward branch; an innermost loop contains no other) and over
  the whole kernel;
- the instruction mix (HMMA.16816, LDSM, LDGSTS, MUFU.EX2, BAR, shared loads and stores, FFMA,
  ...) of the main loop per iteration (the innermost loop with tensor-core instructions, else
  the largest innermost loop), of the loop around it, and of the whole kernel (``mix``);
- MODEL: bytes in flight per SM = global loads in flight per warp x width x 32 lanes x resident
  warps, where the loads in flight per warp are the global loads of the innermost loop that loads
  the most bytes, assumed all issued before the first is used;
- MODEL (``paged_decode`` only): shared-memory cycles per K/V tile against DRAM cycles per tile,
  see ``decode_bank_model`` (``decode_mma_bank_model`` for the tensor-core kernel,
  ``paged_decode_mma``), and issue cycles per tile, see ``decode_issue_model``.

Nothing here is measured on a GPU: the counts are static analysis of the compiled code, the
occupancy is arithmetic on published limits, and every ``model`` column is a model.

Usage:
    scripts/kernel-report --quick                      # a representative subset, markdown
    scripts/kernel-report --quick --arch sm_75         # the same on T4
    scripts/kernel-report --json report.json           # everything, markdown and JSON
    scripts/kernel-report --kernel paged_decode --dtype float16,bfloat16 --head-dim 128 \\
        --block-size 16 --group 1,4,8 --gpu H100
    scripts/kernel-report --decode-register-table      # target.DECODE_REGISTERS, anew

(``python -m tools.kernel_report`` from the checkout is the same command.) Needs CuPy's NVRTC
binding (the cuda12 or cuda13 extra) and ``nvdisasm`` (the ``report`` extra: the
``nvidia-cuda-nvdisasm`` wheel; or ``CUPAGED_NVDISASM=/path/to/nvdisasm``).

The modules, in the order of a run:

=============  ===================================================================================
``cli``        the options, and ``main``
``launches``   the instantiations the launch tables pick per architecture, one ``Launch`` each
``compile``    NVRTC: cubins and ptxas's resource lines
``sass``       nvdisasm: memory instructions by width, innermost loops
``mix``        the instruction mix: the main loop, the loop around it, the whole kernel
``bank``       MODEL: shared-memory bank cycles of the kernels' access patterns
``models``     MODEL: issue, pipe and DRAM cycles per tile
``report``     the rows: one per launch and GPU
``tables``     the rows as markdown
``registers``  ``DECODE_REGISTERS`` anew, for ``cupaged/kernels/target.py``
=============  ===================================================================================
"""
