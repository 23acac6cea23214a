"""The bookkeeping of a paged KV cache: ids and ints in NumPy, no K/V arrays.

One owner per piece of state, composed by :class:`~cupaged.BlockManager`:

=====================  ===========================================================================
``transaction``        :class:`Transaction`: the guard and undo log of the call in progress
``pool``               :class:`~cupaged.BlockPool`: free stack, refcounts, key map; ``lru`` its LRU
``sequences``          :class:`SequenceTable` (rows, lengths, ids) and the verbs that write them
``batch``              :class:`~cupaged.SequenceBatch`: a step's rows, its device block tables
``prefix``             :class:`~cupaged.PrefixCache`: the chain walk, matching a prompt
``chains``             each sequence's prefix chain and the registration of its full blocks
``tokens``             token ids and counts, checked at the boundary
``planner``            a step's slots, new blocks and copy-on-write copies
``window``             a sliding window's release of the blocks no query can see any more
``copies``             copy-on-write pairs left to apply, and the holds on their sources
``manager``            :class:`~cupaged.BlockManager`: the public lifecycle, swapping's
                       bookkeeping, ``transaction()`` for compound calls
``results``            :class:`~cupaged.StepPlan`, :class:`~cupaged.Admission`
=====================  ===========================================================================

The device copies of tables and slots are made at the manager's public boundary. Nothing here
holds K/V: :class:`~cupaged.PagedCache` has a manager and calls only its public verbs, moving
the bytes of the block ids they hand over.
"""
