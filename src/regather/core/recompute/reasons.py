"""What the graph checks (:mod:`.graph`) say when a producer cannot serve as a recompute source: the texts
alone, torch-free, so the front ends' reason tables and the ``regather`` command's parsers load no torch."""

from __future__ import annotations

#: What :func:`~.graph.kept_between` says of a producer whose autograd node keeps nothing: its input and
#: its weights need no gradient (a norm at layer 0 under frozen embeddings, a router likewise).
NOTHING_KEPT = "it keeps nothing for its backward (neither its input nor its weights need a gradient)"
SOURCE_NOT_KEPT = "it does not keep the tensor it would be recomputed from (saving that would add bytes)"
