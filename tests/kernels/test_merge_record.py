"""``kernels.args.merge_record``: a merge kernel's record takes its kernel's values by name."""

from __future__ import annotations

import numpy as np
import pytest

from cupaged.kernels.args import (
    DecodeArgs,
    DecodeMergeArgs,
    PrefillArgs,
    PrefillMergeArgs,
    fields,
    merge_record,
)


def _distinct(record: type) -> tuple:
    """A record whose every field holds its own object: a copy by name shows in the identities."""
    return record(*(object() for _ in fields(record)))


@pytest.mark.parametrize(
    "kernel, merge, own",
    [
        (PrefillArgs, PrefillMergeArgs, ()),
        (DecodeArgs, DecodeMergeArgs, ("seq_items", "num_q_heads")),
    ],
)
def test_merge_record_takes_each_shared_field_from_its_kernel(kernel, merge, own):
    planned = _distinct(kernel)
    given = {name: object() for name in own}
    got = merge_record(planned, merge, **given)
    assert type(got) is merge
    for name in fields(merge):
        want = given[name] if name in own else getattr(planned, name)
        assert getattr(got, name) is want, name


def test_merge_record_refuses_a_field_it_cannot_fill():
    with pytest.raises(AttributeError, match="num_q_heads"):
        merge_record(_distinct(DecodeArgs), DecodeMergeArgs, seq_items=np.zeros((1, 2), np.int32))
