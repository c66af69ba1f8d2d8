"""Chat templates of the model families, for generated checkpoints: each renders the family's own prompt and
tool-call format (the token strings and layout of the published checkpoints' templates), so a tiny model is served
exactly as the real one is. `FAMILIES[name]` = (template, special tokens, bos, eos).

    deepseek_v3   <｜User｜>…<｜Assistant｜>…<｜end▁of▁sentence｜>; calls: <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                  ```json ARGS ```<｜tool▁call▁end｜> inside <｜tool▁calls▁begin｜>…<｜tool▁calls▁end｜>; results inside
                  <｜tool▁outputs▁begin｜>…<｜tool▁outputs▁end｜>
    deepseek_r1   the same, the answer after <think>…</think> (the prompt opens the <think>)
    deepseek_v31  calls: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>; `thinking` switches the
                  prompt's end between <think> (reasoning first) and </think>
    kimi_k2       <|im_user|>user<|im_middle|>…<|im_end|>; calls: <|tool_call_begin|>functions.NAME:I
                  <|tool_call_argument_begin|>ARGS<|tool_call_end|> inside <|tool_calls_section_begin|>…_end|>
    kimi_k2_thinking  the same, the answer after <think>…</think> (the model opens the <think>)
"""
from __future__ import annotations

DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
DS_TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
             "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
             "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<think>", "</think>"]
KIMI_BOS, KIMI_EOS = "[BOS]", "[EOS]"
KIMI_TOKENS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
               "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"]

# The system prompt of the DeepSeek templates: system messages joined by blank lines, then the tools (JSON schemas)
# and the call format the family's model was trained on.
_DS_SYSTEM = """
{%- set ns = namespace(system='', first=true) -%}
{%- for m in messages if m['role'] == 'system' -%}
  {%- set ns.system = ns.system + ('' if ns.first else '\n\n') + m['content'] -%}{%- set ns.first = false -%}
{%- endfor -%}
{%- if tools -%}
  {%- set ns.system = ns.system + ('\n\n' if ns.system else '') +
      '## Tools\nYou have access to the following tools:\n' -%}
  {%- for t in tools -%}
    {%- set f = t['function'] -%}
    {%- set ns.system = ns.system + '\n### ' + f['name'] + '\nDescription: ' + (f.get('description') or '') +
        '\n\nParameters: ' + (f.get('parameters') or {}) | tojson + '\n' -%}
  {%- endfor -%}
  {%- set ns.system = ns.system + '\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n' + CALL_FORMAT -%}
{%- endif -%}
{{ bos_token }}{{ ns.system }}
"""

_DS_V3 = _DS_SYSTEM.replace("CALL_FORMAT", """'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>\
tool_call_name\\n```json\\ntool_call_arguments\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\\n'""") + """
{%- set st = namespace(tool=false, first_output=true) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}
    {%- set st.tool = false -%}<｜User｜>{{ m['content'] }}
  {%- elif m['role'] == 'assistant' -%}
    {%- set content = m['content'] or '' -%}
    {%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}
    {%- if st.tool -%}<｜tool▁outputs▁end｜>{%- else -%}<｜Assistant｜>{%- endif -%}
    {%- set st.tool = false -%}{%- set st.first_output = true -%}{{ content }}
    {%- if m.get('tool_calls') -%}<｜tool▁calls▁begin｜>
      {%- for c in m['tool_calls'] -%}
        {{ '\n' if not loop.first }}<｜tool▁call▁begin｜>{{ c.get('type', 'function') }}<｜tool▁sep｜>
        {{- c['function']['name'] }}
```json
{{ c['function']['arguments'] }}
```<｜tool▁call▁end｜>
      {%- endfor -%}<｜tool▁calls▁end｜>
    {%- endif -%}<｜end▁of▁sentence｜>
  {%- elif m['role'] == 'tool' -%}
    {%- if st.first_output -%}<｜tool▁outputs▁begin｜>{%- endif -%}
    {%- set st.tool = true -%}{%- set st.first_output = false -%}
    <｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>
  {%- endif -%}
{%- endfor -%}
{%- if st.tool -%}<｜tool▁outputs▁end｜>{%- endif -%}
{%- if add_generation_prompt and not st.tool -%}<｜Assistant｜>{{ GEN_SUFFIX }}{%- endif -%}
"""
DEEPSEEK_V3 = _DS_V3.replace("{{ GEN_SUFFIX }}", "")
DEEPSEEK_R1 = _DS_V3.replace("{{ GEN_SUFFIX }}", "<think>\n")

DEEPSEEK_V31 = ("{%- set thinking = thinking if thinking is defined else (enable_thinking if enable_thinking is defined"
                " else false) -%}") + _DS_SYSTEM.replace(
    "CALL_FORMAT", """'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments\
<｜tool▁call▁end｜><｜tool▁calls▁end｜>\\n'""") + """
{%- set st = namespace(tool=false, last_user=false) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}
    {%- set st.tool = false -%}{%- set st.last_user = true -%}<｜User｜>{{ m['content'] }}
  {%- elif m['role'] == 'assistant' -%}
    {%- set content = m['content'] or '' -%}
    {%- if '</think>' in content -%}{%- set content = content.split('</think>', 1)[1] -%}{%- endif -%}
    {%- if st.last_user -%}<｜Assistant｜></think>{%- endif -%}
    {%- set st.last_user = false -%}{%- set st.tool = false -%}{{ content }}
    {%- if m.get('tool_calls') -%}<｜tool▁calls▁begin｜>
      {%- for c in m['tool_calls'] -%}
        <｜tool▁call▁begin｜>{{ c['function']['name'] }}<｜tool▁sep｜>{{ c['function']['arguments'] }}<｜tool▁call▁end｜>
      {%- endfor -%}<｜tool▁calls▁end｜>
    {%- endif -%}<｜end▁of▁sentence｜>
  {%- elif m['role'] == 'tool' -%}
    {%- set st.last_user = false -%}{%- set st.tool = true -%}
    <｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and st.last_user -%}<｜Assistant｜>{{ '<think>' if thinking else '</think>' }}{%- endif -%}
"""

_KIMI = """
{%- macro text(m) -%}
  {%- if m['content'] is string -%}{{ m['content'] }}
  {%- elif m['content'] is not none -%}{%- for p in m['content'] -%}{{ p.get('text', '') }}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}
{%- if not messages or messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}<|im_user|>{{ m.get('name') or 'user' }}<|im_middle|>{{ text(m) }}
  {%- elif m['role'] == 'assistant' -%}<|im_assistant|>{{ m.get('name') or 'assistant' }}<|im_middle|>
    {{- THINK }}{{ text(m) }}
    {%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>
      {%- for c in m['tool_calls'] -%}
        <|tool_call_begin|>{{ c['id'] }}<|tool_call_argument_begin|>
        {{- c['function']['arguments'] if c['function']['arguments'] is string
            else c['function']['arguments'] | tojson -}}
        <|tool_call_end|>
      {%- endfor -%}<|tool_calls_section_end|>
    {%- endif -%}
  {%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.get('tool_call_id') }}
{{ text(m) }}
  {%- else -%}<|im_system|>{{ m.get('name') or m['role'] }}<|im_middle|>{{ text(m) }}
  {%- endif -%}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""
KIMI_K2 = _KIMI.replace("{{- THINK }}", "{{- '' }}")
# K2-Thinking: past answers carry an empty <think></think>; the reasoning of the turn in progress (the messages after
# the last plain answer) is kept
KIMI_K2_THINKING = """
{%- set ns = namespace(last=-1) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}{%- set ns.last = loop.index0 -%}{%- endif -%}
{%- endfor -%}
""" + _KIMI.replace("{{- THINK }}", "{{- '<think>' ~ (m.get('reasoning_content') or '' if loop.index0 > ns.last "
                                     "else '') ~ '</think>' }}")

FAMILIES = {
    "deepseek_v3": (DEEPSEEK_V3, DS_TOKENS, DS_BOS, DS_EOS),
    "deepseek_r1": (DEEPSEEK_R1, DS_TOKENS, DS_BOS, DS_EOS),
    "deepseek_v31": (DEEPSEEK_V31, DS_TOKENS, DS_BOS, DS_EOS),
    "kimi_k2": (KIMI_K2, KIMI_TOKENS, KIMI_BOS, KIMI_EOS),
    "kimi_k2_thinking": (KIMI_K2_THINKING, KIMI_TOKENS, KIMI_BOS, KIMI_EOS),
}
