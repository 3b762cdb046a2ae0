"""The package's version, in a module of its own: read by setup (pyproject.toml), by
``__init__`` and by the modules ``__init__`` reaches, without a circle."""
__version__ = "0.1.0"
