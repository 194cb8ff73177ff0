"""A module whose import fails, for ``--middleware`` start-up errors."""

raise RuntimeError("this module cannot be imported")
