"""The installed qinfer's version, which `qinfer --version` prints and servers report."""

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("qinfer")
except PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0+unknown"
