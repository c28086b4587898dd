"""The test suite (a package, so that ``tests/`` itself is never a ``sys.path`` entry: its folder
``tests/unit/megatron`` would otherwise join megatron-core's ``megatron`` namespace package and shadow
``megatron.bridge``; the test folders below are put on the path by ``tests/conftest.py``)."""
