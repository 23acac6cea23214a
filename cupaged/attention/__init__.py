"""Attention over a paged cache: the plans, the functional API and the oracle.

==============  ========================================================================
``layer``       what the plans share: the device planned for, a layer's array checks
``scales``      an fp8 cache's K/V scales, checked once for every function that takes them
``decode``      :class:`~cupaged.DecodePlan`: one query per sequence, planned once per step
``graph``       :class:`~cupaged.DecodeGraph`: a decode step captured once as a CUDA graph
``prefill``     :class:`~cupaged.PrefillPlan`: many queries per sequence
``ops``         :func:`~cupaged.write_kv`, :func:`~cupaged.copy_blocks`,
                :func:`~cupaged.paged_attention`, :func:`~cupaged.paged_prefill`
``page_table``  :func:`~cupaged.to_csr` and :func:`~cupaged.from_csr`
``reference``   :func:`~cupaged.reference_attention`, :func:`~cupaged.reference_prefill`:
                plain array ops, sharing no code with the kernels
==============  ========================================================================
"""
