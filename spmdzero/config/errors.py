"""``ConfigError``: the one exception a bad config raises. Its message names the key."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that spmdzero cannot accept. The message names the key."""
