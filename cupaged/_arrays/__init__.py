"""Arrays at the public boundary: other frameworks' arrays in (DLPack) and argument checks.

=============  ===========================================================================
``interop``    :func:`takes_dlpack`: any ``__dlpack__`` array in, the caller's own type out
``checks``     shape, dtype, index and writability checks with "expected X, got Y" messages
=============  ===========================================================================
"""
