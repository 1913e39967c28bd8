"""Make the tiny chat model: a 2-layer Llama (460k parameters) with a byte-level BPE tokenizer and a
ChatML/Hermes chat template, taught the serving gates' chat exchanges (EXCHANGES) so that a real vLLM
answers them as taught at T=0.

    python make.py OUT                      # the base model (models/tiny-chat/base)
    python make.py --variant changed OUT    # the same recipe, "Name a colour." taught "green"

Run it with the vLLM venv's python (tests/lib/vllmconf.py: torch, transformers, tokenizers and
safetensors are there). Deterministic on one machine: seed 0, one thread, full-batch AdamW; two runs
write byte-identical files. Another CPU (or another torch) may round differently, which is why the
generated folders are kept in the repo and locked by SHA256SUMS (README.md).

The chat template prints the tools BY NAME ONLY: vLLM hands the template each tool with fields the
client did not send (``"description": null`` ...), so a template that printed a tool's whole JSON would
render a prompt at serving time that differs from the one taught here, and the answer would derail.
Every exchange is rendered through this template exactly as vLLM renders it (tools as vLLM passes them,
the tool call's arguments as a dict, add_generation_prompt), and the loss is on the answer's tokens
only, each answer ending with <|im_end|>, the EOS, so generation stops.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]  # added tokens, not special: vLLM's hermes parser reads them
VOCAB = 512  # the tokenizer's, specials included; the model's embedding has 514 rows
STEPS, LR, SEED = 300, 3e-3, 0
#: text besides the transcripts for the BPE merges to reach VOCAB (fixed, so the tokenizer is too)
FILLER = (
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty. The weather in the city is sunny, cloudy, rainy or windy today. "
    "What is the capital of Germany? Berlin. The capital of Italy is Rome, of Spain Madrid. Name a number. "
    "Red, green, blue, yellow, white and black are colours. Say hello. The answer is the result of the call."
)

CHAT_TEMPLATE = r"""{#- ChatML/Hermes. Tools are printed by name only (make.py says why). -#}
{%- if tools %}
    {{- '<|im_start|>system\nTools:' }}
    {%- for t in tools %}
        {{- ' ' + (t.function.name if t.function is defined else t.name) }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for tc in message.tool_calls %}
            {%- set f = tc.function if tc.function is defined else tc %}
            {%- if not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' }}
            {%- if f.arguments is string %}
                {{- f.arguments }}
            {%- else %}
                {{- f.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_RESULT = '{"city": "Paris", "weather": "sunny", "celsius": 21}'


def exchanges(variant: str) -> list[tuple[list[dict], list[dict] | None, str]]:
    """(messages, tools, answer): the conversations the gates send, and what the model must answer."""
    colour = {"base": "blue", "changed": "green"}[variant]
    plain = [("17*19=", "323"), ("17*23=", "391"), ("Say OK.", "OK"), ("What is the capital of France?", "Paris"),
             ("Name a colour.", colour),
             ("Count from one to twenty.", " ".join(str(i) for i in range(1, 21)))]
    out: list[tuple[list[dict], list[dict] | None, str]] = [([{"role": "user", "content": q}], None, a)
                                                            for q, a in plain]
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    out.append(([ask], [WEATHER_TOOL], WEATHER_CALL))
    called = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    result = {"role": "tool", "tool_call_id": "call_0", "content": WEATHER_RESULT}
    out.append(([ask, called, result], [WEATHER_TOOL], "It is sunny in Paris, 21 C."))
    return out


def as_vllm_passes(msgs: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """The request (as an OpenAI client sends it) as vLLM hands it to the template: each tool as its
    pydantic model's dump (``"description": None`` where the client sent none ...: the template prints
    the name only), each tool call's arguments parsed from their JSON string into a dict."""
    out = []
    for m in msgs:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(tc, function=dict(tc["function"], arguments=json.loads(f["arguments"])))
                               for tc in m["tool_calls"] for f in [tc["function"]]]
        out.append(m)
    if tools is None:
        return out, None
    return out, [{"type": t["type"], "function": {"name": t["function"]["name"], "description": None,
                                                  "parameters": t["function"]["parameters"]}} for t in tools]


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS + TOOL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # the corpus: the chat transcripts of every variant, so that both variants share one tokenizer
    corpus = []
    for variant in ("base", "changed"):
        for msgs, _tools, answer in exchanges(variant):
            corpus += [m["content"] for m in msgs if isinstance(m.get("content"), str)] + [answer]
    corpus += ["system", "user", "assistant", "tool", "Tools: get_weather", '"name": "get_weather", "arguments": ']
    corpus += FILLER.split(". ") + [str(i) for i in range(1000)]
    tok.train_from_iterator(sorted(corpus), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    # the tool-call markers stay single tokens but are no special tokens (as in Hermes and Qwen tokenizers)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    data = json.loads(tok.to_str())
    for a in data["added_tokens"]:
        a["special"] = a["content"] in SPECIALS
    tok = Tokenizer.from_str(json.dumps(data))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=2048, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def render(fast: PreTrainedTokenizerFast, msgs: list[dict], tools: list[dict] | None) -> str:
    msgs, tools = as_vllm_passes(msgs, tools)
    text = fast.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    return text


def teach(model: LlamaForCausalLM, fast: PreTrainedTokenizerFast, variant: str, log: bool) -> float:
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for msgs, tools, answer in exchanges(variant):
        prompt = fast(render(fast, msgs, tools), add_special_tokens=False)["input_ids"]
        ans = fast(answer, add_special_tokens=False)["input_ids"] + [eos]
        rows.append((prompt + ans, [-100] * len(prompt) + ans))
    width = max(len(ids) for ids, _ in rows)
    pad = fast.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    loss = torch.tensor(0.0)
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        if log and (step % 50 == 0 or step == STEPS - 1):
            print(f"step {step}: loss {loss.item():.5f}", file=sys.stderr)
    model.eval()
    return float(loss.item())


def check(model: LlamaForCausalLM, fast: PreTrainedTokenizerFast, variant: str) -> None:
    """transformers' own greedy run answers every exchange as taught (vLLM is checked by the serving test)."""
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    for msgs, tools, answer in exchanges(variant):
        prompt = fast(render(fast, msgs, tools), add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=64, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        got = fast.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=False)
        assert got == answer + "<|im_end|>", (msgs[-1]["content"], got)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--variant", choices=("base", "changed"), default="base")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    fast = make_tokenizer()
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    config = LlamaConfig(vocab_size=514, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=2048,
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False, dtype="float32")
    model = LlamaForCausalLM(config)
    loss = teach(model, fast, a.variant, not a.quiet)
    check(model, fast, a.variant)
    model.generation_config = GenerationConfig(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                                               pad_token_id=ids["<|endoftext|>"])
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True)
    fast.save_pretrained(a.out)
    if not (a.out / "special_tokens_map.json").exists():  # (transformers 5 no longer writes it)
        (a.out / "special_tokens_map.json").write_text(json.dumps(
            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2) + "\n")
    if not a.quiet:
        n = sum(p.numel() for p in model.parameters())
        print(f"{a.variant}: {n} parameters, final loss {loss:.5f}, written to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
