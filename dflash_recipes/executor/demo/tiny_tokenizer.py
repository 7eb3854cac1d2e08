"""A tiny, deterministic, offline tokenizer for tests and the embedded demo.

Byte-level BPE trained on the given texts (every byte is in the alphabet, so any text encodes),
wrapped in a ``PreTrainedTokenizerFast`` with a ChatML-like chat template whose assistant
turns are wrapped in ``{% generation %}`` markers (so ``return_assistant_tokens_mask`` works).

Vocabulary layout, fixed so that ids never move between builds:

- ``0 .. 2``: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos / end of turn)
- then the 256 byte symbols and the learned merges
- the top ``NUM_SPARE_TOKENS`` ids: ``<|spare_0|>`` ... never produced by encoding ordinary text
  (only by their literal spelling), usable as a DFlash mask token (see :func:`spare_token_ids`),
  like Qwen3's unused embedding rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
NUM_SPARE_TOKENS = 8
SPARE_TOKENS: tuple[str, ...] = tuple(f"<|spare_{i}|>" for i in range(NUM_SPARE_TOKENS))
#: Learned vocabulary size before the spare tokens (specials + bytes + merges, at most).
DEFAULT_BPE_VOCAB_SIZE = 384

#: ChatML with the assistant content and its end-of-turn token inside generation markers, and
#: this project's own tool and reasoning syntax: a row's `tools` are listed in a system turn
#: (after the row's own system text), an assistant's reasoning is a ``<think>`` block before its
#: text, each tool call a ``<call>{"name": ..., "arguments": {...}}</call>`` after it, and a
#: tool result a ``tool`` turn. A row without tools, calls or reasoning renders as plain ChatML.
TINY_CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- 'You may call these tools:\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson + '\\n' -}}{%- endfor -%}"
    '{{- \'Call one with <call>{"name": ..., "arguments": {...}}</call>.<|im_end|>\\n\' -}}'
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (tools and loop.first and message['role'] == 'system') -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}"
    "{%- if message.get('reasoning_content') -%}"
    "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n' -}}"
    "{%- endif -%}"
    "{{- message['content'] -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<call>' + {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson + '</call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_tiny_tokenizer(
    texts: Sequence[str],
    out_dir: Path | None = None,
    *,
    vocab_size: int = DEFAULT_BPE_VOCAB_SIZE,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and wrap it with the ChatML template.

    The same texts give the same tokenizer (ids, merges, template) in every process. When
    `out_dir` is given the tokenizer is also saved there (``save_pretrained``), so it can be
    loaded with ``AutoTokenizer.from_pretrained(out_dir)`` next to a tiny target model.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[PAD_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Sorted so the trainer sees the same corpus order whatever order the caller used.
    tokenizer.train_from_iterator(sorted(texts), trainer=trainer)
    tokenizer.add_special_tokens(list(SPARE_TOKENS))
    wrapped = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START, *SPARE_TOKENS],
        padding_side="right",
        model_max_length=1 << 20,
    )
    wrapped.chat_template = TINY_CHAT_TEMPLATE
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        wrapped.save_pretrained(str(out_dir))
    return wrapped


def spare_token_ids(tokenizer: PreTrainedTokenizerFast) -> tuple[int, ...]:
    """Ids of the spare tokens (the top of the vocabulary); the first suits a mask token."""
    ids = tokenizer.convert_tokens_to_ids(list(SPARE_TOKENS))
    return tuple(ids) if isinstance(ids, list) else (ids,)


__all__ = [
    "NUM_SPARE_TOKENS",
    "TINY_CHAT_TEMPLATE",
    "build_tiny_tokenizer",
    "spare_token_ids",
]
