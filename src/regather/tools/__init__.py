"""The ``regather`` command (:mod:`.cli`): ``demo``, ``bench``, ``estimate``, ``doctor``.

Tools sit on top of everything: they build models with the harness (:mod:`regather.testing`),
apply the front ends and read the core's byte accounting; nothing imports them.
"""
