"""pskv: a parameter-server key-value store for data-parallel deep learning."""
from kvstore._version import __version__
