"""aglverl's version (what the package, and the embedded engine's ``system_fingerprint``, report)."""

__version__ = "0.1.0"
