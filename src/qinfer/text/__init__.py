"""Text in and out of the model: the tokenizer (`tokenizer.py`), chat templates
(`chat_template.py`), prompts as ids (`prompts.py`), incremental detokenizing
(`detokenizer.py`), reasoning blocks (`reasoning.py`) and fill-in-the-middle prompts
(`fill_in_middle.py`). Tool calls, which need the grammar, are `qinfer.request.tool_calls`."""
