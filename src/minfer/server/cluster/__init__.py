"""``minfer serve --ray``: replicas of the single-process server on Ray Serve, behind one HTTP front.

Each replica is the unchanged ``minfer serve`` process (:mod:`.engine_process`), started and kept alive
by a Ray Serve deployment (:mod:`.replica`); the front (:mod:`.front`) answers ``/health`` and
``/metrics`` for the whole set and passes every other request through to the replica its prefix picks
(:mod:`.prefix`, :mod:`.routing_key`). Only :mod:`.replica` and :mod:`.launch` import Ray, and nothing
outside this package imports them, so the plain server never loads it.
"""
