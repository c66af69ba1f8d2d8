"""The errors hybrid raises for bad input. Each message names the file, tensor or setting at fault."""


class HybridError(Exception):
    """Base of every error hybrid raises on purpose."""


class ConfigError(HybridError, ValueError):
    """An invalid or inconsistent configuration."""


class CheckpointError(HybridError, ValueError):
    """A checkpoint that is missing, corrupt, or does not match its config."""


class UnsupportedArchitecture(CheckpointError):
    """A checkpoint whose config.json names a model family hybrid does not run."""
