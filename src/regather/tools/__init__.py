"""The ``regather`` command (:mod:`.cli`): ``demo``, ``bench``, ``estimate``, ``doctor``.

Tools sit on top of everything: they describe a run with :mod:`.shapes`, build and run models on
CPU ranks with :mod:`.cpu`, apply the front ends and read the core's byte accounting; nothing in
the library imports them.
"""
