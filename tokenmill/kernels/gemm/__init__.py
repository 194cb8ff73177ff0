"""Matrix products."""
