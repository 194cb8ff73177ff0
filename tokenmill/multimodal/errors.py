"""The error of a bad image setting or of a model whose images tokenmill cannot lay out."""

from __future__ import annotations


class MultiModalConfigError(ValueError):
    """An invalid --limit-mm-per-prompt, --allowed-media-domains, --allowed-local-media-path
    or --mm-processor-kwargs value, a vision encoder tokenmill does not run, or a tokenizer
    without the tokens a model's image layout needs."""
