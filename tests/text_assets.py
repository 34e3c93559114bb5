"""Tokenizers and chat templates for the text-layer tests, built here (no hub downloads).

`train_tokenizer()` trains a tiny byte-level BPE (the GPT-2 / Qwen / Llama 3 kind) on a
few sentences: characters it never saw, such as most emoji, stay split into several
byte tokens, which is what the streaming detokenizer has to cope with.
`save_tokenizer_folder()` writes it out as a checkpoint folder would hold it, so that
`transformers.AutoTokenizer` (the reference) and `qinfer.load_tokenizer` read the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3 marks these as added tokens that are not "special": they survive skip_special_tokens.
QWEN3_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
LLAMA3_SPECIAL += ["<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "The weather in Paris is sunny; in Tokyo it rains.",
    "Answer: 42. The reasoning is simple and the answer is short.",
    "你好，世界。今天天气很好。",
    "Stop words: STOP, END, </answer>, ###.",
] * 20


def train_tokenizer(
    special_tokens: list[str], added_tokens: list[str] = ()
) -> tokenizers.Tokenizer:
    """A byte-level BPE with ~400 entries trained on CORPUS, plus the given added tokens."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.add_tokens([tokenizers.AddedToken(t, special=False) for t in added_tokens])
    return backend


def save_tokenizer_folder(
    folder: Path,
    backend: tokenizers.Tokenizer,
    *,
    chat_template: str | None = None,
    template_file: bool = False,
    generation_config: dict | None = None,
    config: dict | None = None,
    **special_tokens: str,
) -> Path:
    """Write tokenizer.json, tokenizer_config.json (+ chat_template.jinja, configs) to folder.

    template_file: put the template in chat_template.jinja (transformers >= 4.50) instead
    of tokenizer_config.json. special_tokens: bos_token="...", eos_token="...", ...
    """
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **special_tokens}
    if chat_template is not None and template_file:
        (folder / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    elif chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    for name, content in (("generation_config.json", generation_config), ("config.json", config)):
        if content is not None:
            (folder / name).write_text(json.dumps(content), encoding="utf-8")
    return folder


# Qwen3's chat template as shipped in Qwen/Qwen3-0.6B's tokenizer_config.json (April 2025).
QWEN3_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Llama 3.2 Instruct's chat template (tools in the first user message, strftime_now date).
LLAMA3_CHAT_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def save_qwen3_tokenizer(
    folder: Path, backend: tokenizers.Tokenizer | None = None
) -> tokenizers.Tokenizer:
    """Write a Qwen3 tokenizer folder: `backend` (default: `train_tokenizer` with ChatML's
    special tokens and Qwen3's added ones), Qwen3's chat template, its EOS and pad tokens.
    Returns the backend."""
    backend = backend or train_tokenizer(CHATML_SPECIAL, QWEN3_ADDED)
    save_tokenizer_folder(
        folder,
        backend,
        chat_template=QWEN3_CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    return backend


#: Qwen3.5's chat template (XML tool calls, tools in `<tools>`), as released with its
#: checkpoints: the text found quoted whole in a public repository's fallback table for
#: Qwen3.5 models (no hub download here); stored beside this module.
QWEN3_5_CHAT_TEMPLATE = (Path(__file__).parent / "qwen3_5_chat_template.jinja").read_text(
    encoding="utf-8"
)


def save_qwen3_5_tokenizer(
    folder: Path, backend: tokenizers.Tokenizer | None = None
) -> tokenizers.Tokenizer:
    """Write a Qwen3.5 tokenizer folder: `backend` (default: `train_tokenizer` with
    ChatML's special tokens and Qwen's added ones), Qwen3.5's chat template, its EOS and
    pad tokens. Returns the backend."""
    backend = backend or train_tokenizer(CHATML_SPECIAL, QWEN3_ADDED)
    save_tokenizer_folder(
        folder,
        backend,
        chat_template=QWEN3_5_CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    return backend


def save_llama3_tokenizer(folder: Path) -> Path:
    """Write a Llama 3.2 tokenizer folder (its template in chat_template.jinja)."""
    return save_tokenizer_folder(
        folder,
        train_tokenizer(LLAMA3_SPECIAL),
        chat_template=LLAMA3_CHAT_TEMPLATE,
        template_file=True,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )


def tokenizer_pair(folder: Path):
    """(qinfer's tokenizer, transformers' AutoTokenizer) over the same folder."""
    from transformers import AutoTokenizer

    import qinfer

    return qinfer.load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
