"""Every input that crashed or read outside its arrays is now a clear exception (issue 10).

Each case of ``kernel_safety_cases.py`` runs in its own child process: a SIGSEGV, a SIGABRT or a
hang there fails this one test (exit code, timeout) instead of killing the run. The child must exit
0 and print what the case expects: a ``ValueError`` naming the problem, or a result equal to the
reference (an understated ``max_context_len`` must change nothing).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_safety_cases import CASES

TESTS = Path(__file__).parent

EXPECTED = {
    "block_id_1e6": r"refused ValueError: expected block ids in [0, 8) in row 0",
    "block_id_minus_1e6": r"refused ValueError: expected block ids in [0, 8) in row 0",
    "block_id_num_blocks": r"refused ValueError: expected block ids in [0, 8) in row 0",
    "block_id_minus_1": r"refused ValueError: expected block ids in [0, 8) in row 0",
    "block_id_2_32_plus_1_int64": r"refused ValueError: expected block ids in [0, 8) in row 0",
    "context_49_of_48": "refused ValueError: expected context_lens in [0, 48]",
    "context_5000": "refused ValueError: expected context_lens in [0, 48]",
    "context_2_31_minus_1_max_32": "refused ValueError: expected context_lens in [0, 48]",
    "context_negative": "refused ValueError: expected context_lens in [0, 48]",
    "context_2_32_plus_5_int64": "refused ValueError: expected context_lens in [0, 48]",
    "max_context_len_understated": "correct",
    "max_context_len_understated_unchecked": "correct",
    "slot_1e6": "refused ValueError: expected slot_mapping values in [0, 128)",
    "slot_2_33": "refused ValueError: expected slot_mapping values in [0, 128)",
    "slot_one_past_the_end": "refused ValueError: expected slot_mapping values in [0, 128)",
    "slot_minus_2": "refused ValueError: expected slot_mapping values in [0, 128)",
    "copy_src_1e6": "refused ValueError: expected block ids in [0, 8) in src and dst",
    "copy_dst_1e6": "refused ValueError: expected block ids in [0, 8) in src and dst",
    "copy_src_minus_3": "refused ValueError: expected block ids in [0, 8) in src and dst",
    "copy_src_2_32_plus_1_int64": "refused ValueError: expected block ids in [0, 8) in src and dst",
    "read_only_out": "refused ValueError: expected out writable",
    "write_kv_into_bytes": "refused ValueError: expected k_cache writable",
    "copy_blocks_read_only": "refused ValueError: expected k_cache writable",
}


def child_environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    folders = [TESTS.parents[1], TESTS.parent, TESTS]  # the checkout, tests/ (helpers), the cases
    env["PYTHONPATH"] = os.pathsep.join([*map(str, folders), env.get("PYTHONPATH", "")])
    return env


def test_every_case_has_an_expectation():
    assert set(EXPECTED) == set(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_crashing_input_is_a_clear_exception_in_a_child_process(case):
    result = subprocess.run(
        [sys.executable, str(TESTS / "kernel_safety_cases.py"), case],
        capture_output=True,
        text=True,
        env=child_environment(),
        timeout=300,
    )
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-3000:]}"
    line = result.stdout.strip()
    assert line.startswith(f"{case}: {EXPECTED[case]}"), line + result.stderr[-2000:]
