"""Tools of the cupaged checkout, run from it (``scripts/`` calls them); not in the wheel."""
