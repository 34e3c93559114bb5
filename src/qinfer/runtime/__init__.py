"""What runs a scheduled step: the plain step the engine hands over (`step.py`:
`ScheduledStep`, `logits_rows`), one rank's runner that turns it into a `ForwardBatch`
over its KV pools (`runner.py`; decode steps padded to fixed shapes in
`static_decode.py`, replayed as CUDA graphs in `cuda_graphs.py`), the executor that runs
it on every rank (`executor.py`), the channel that hands each step to tensor-parallel
workers (`step_channel.py`) and how such a group starts (`distributed.py`)."""
