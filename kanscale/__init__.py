"""The ground floor every layer may import: the version, the error users see, and the config
files the suite ships (``kanscale.files``). Nothing here imports another kanscale package."""

from importlib import metadata

try:
    __version__ = metadata.version("kanscale")
except metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
