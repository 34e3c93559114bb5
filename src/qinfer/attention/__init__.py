"""Attention: the grouped attention functions (`sdpa.py`) and the backends that store a
step's K/V and attend (`backend.py` states the protocol; `reference.py`, `paged.py`).

Nothing is imported here: the caches (`qinfer.attention.kv_cache`) use `sdpa.py`'s types while the
reference backend uses the caches, so each module is imported by its own name.
"""
