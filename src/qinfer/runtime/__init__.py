"""What one forward runs on: the `ForwardBatch` contract (`forward_batch.py`), the KV
block pool (`kv_pool.py`), the runner that turns a scheduled step into a forward (`runner.py`)
and the channel that hands each step to tensor-parallel workers (`step_channel.py`)."""
