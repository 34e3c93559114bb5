"""What one forward runs on: the `ForwardBatch` contract (`forward_batch.py`) and the KV
block pool of the engine (`kv_pool.py`)."""
