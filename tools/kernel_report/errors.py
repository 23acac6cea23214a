"""The report's one failure: a missing tool or a failed compile."""

from __future__ import annotations


class ReportError(Exception):
    """A missing tool or a failed compile: one line on stderr, exit status 1."""
