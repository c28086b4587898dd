"""In-process tests (a package, like tests/: this folder never becomes a sys.path entry, see tests/__init__.py)."""
