"""The bottom layer: torch-free vocabulary every other layer shares.

- :mod:`~lessmem.base.units`: byte sizes, rates and times as users type and read them;
- :mod:`~lessmem.base.tierspec`: the ``--offload`` grammar (``TierSpec``), no tier objects;
- :mod:`~lessmem.base.gguf_rules`: llama.cpp's per-tensor GGUF type rules and block sizes;
- :mod:`~lessmem.base.kvprecision`: ``KVPrecision``, how one K/V element is stored;
- :mod:`~lessmem.base.placement`: the tiered cache's placement policy, shared with the planner;
- :mod:`~lessmem.base.corpus`: evaluation and calibration text (the built-in corpus);
- :mod:`~lessmem.base.paths`: where lessmem caches what it builds or downloads;
- :mod:`~lessmem.base.lazy`: public names a package resolves on first use;
- :mod:`~lessmem.base.cpu`: how many cores other work leaves idle (thread counts under load).

Nothing here imports torch, numpy or any other lessmem package: ``base`` is imported by
every layer and imports none of them (``tests/test_layers.py`` checks the import graph).
"""
