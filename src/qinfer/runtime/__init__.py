"""What one forward runs on: the `ForwardBatch` contract (`forward_batch.py`), the KV
block pools (`kv_pool.py`), one per block space (`block_spaces.py`: sliding-window layers
keep only their window), the step's input tensors written in place (`step_buffers.py`),
one rank's runner that turns a scheduled step into a forward (`runner.py`), the executor
that runs it on every rank (`executor.py`) and the channel that hands each step to
tensor-parallel workers (`step_channel.py`)."""
