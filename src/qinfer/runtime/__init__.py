"""What one forward runs on: the `ForwardBatch` contract (`forward_batch.py`), the KV
block pool (`kv_pool.py`), the step's input tensors written in place (`step_buffers.py`),
one rank's runner that turns a scheduled step into a forward (`runner.py`), the executor
that runs it on every rank (`executor.py`) and the channel that hands each step to
tensor-parallel workers (`step_channel.py`)."""
