"""The tokenizer, special tokens and chat template of a Hugging Face model folder.

``tokenizer.json`` is loaded as it is by the ``tokenizers`` library (what transformers' fast tokenizers
wrap), so ids are transformers' own. What transformers reads from the other files we read the same way:

* BOS / EOS: ``tokenizer_config.json`` ``bos_token`` / ``eos_token`` (a string or an AddedToken dict),
  else ``config.json`` ``bos_token_id`` / ``eos_token_id``.
* ``add_bos`` / ``add_eos``: ``tokenizer_config.json`` ``add_bos_token`` / ``add_eos_token`` where given,
  else whether ``tokenizer.json``'s post-processor adds them (Llama 3's TemplateProcessing does).
* End of generation: every id in ``generation_config.json`` ``eos_token_id`` (an int or a list, what
  ``generate`` stops on), ``config.json`` ``eos_token_id`` and EOS; and, as llama.cpp's vocab loader
  does for the GGUF conversion of the same folder, special added tokens spelled like an end of turn.
* Chat template: ``tokenizer_config.json`` ``chat_template`` (a string, or a list of named templates of
  which ``default`` is used), else the file ``chat_template.jinja`` that transformers 4.43+ writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as TokenizersTokenizer

from minfer.errors import FormatError
from minfer.formats.byte_level import token_bytes
from minfer.formats.chat_template import ChatTemplate
from minfer.formats.gguf_vocab import EOG_TEXTS
from minfer.formats.tokenizer import Tokenizer

SPM_SPACE = "\u2581"  # "▁", SentencePiece's space marker


def _decoder_kind(spec: Any) -> str:
    """"byte-level" (GPT-2 byte alphabet), "sentencepiece" (▁ spaces, <0xNN> byte fallback) or "text"."""
    text = json.dumps(spec)
    if '"ByteLevel"' in text:
        return "byte-level"
    if '"ByteFallback"' in text or '"Metaspace"' in text or SPM_SPACE in text:
        return "sentencepiece"
    return "text"


class HFTokenizer(Tokenizer):
    """A :class:`Tokenizer` over a folder's ``tokenizer.json``; ``model`` is ``"hf"``.

    ``token_bytes`` follows the file's decoder: byte-level vocabularies spell bytes in GPT-2's alphabet,
    SentencePiece-style ones write spaces as ▁ and raw bytes as ``<0xNN>`` tokens.
    """

    def __init__(self, backend: TokenizersTokenizer, tokens: list[str], decoder_kind: str, n_model_vocab: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(backend, tokens, **kwargs)
        self.decoder_kind = decoder_kind
        # the model's output layer may be padded past the tokenizer (Qwen2.5: 151936 rows, 151665 tokens);
        # such ids are valid output that decodes to nothing, as the [PAD] tokens of a GGUF conversion do
        self.n_model_vocab = max(n_model_vocab, self.vocab_size)

    def _check_id(self, id: int) -> int:
        if isinstance(id, int) and not isinstance(id, bool) and self.vocab_size <= id < self.n_model_vocab:
            return id
        return super()._check_id(id)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return super().decode([i for i in ids if self._check_id(i) < self.vocab_size], skip_special)

    def token_text(self, id: int) -> str:
        if self._check_id(id) >= self.vocab_size:
            return f"[PAD{id}]"
        return super().token_text(id)

    def token_bytes(self, id: int) -> bytes:
        if self._check_id(id) >= self.vocab_size:
            return b""
        cached = self._bytes_cache.get(id)
        if cached is None:
            text = self._hf.id_to_token(self._check_id(id)) or ""
            if self.decoder_kind == "byte-level":
                cached = token_bytes(text)
            elif self.decoder_kind == "sentencepiece" and len(text) == 6 and text.startswith("<0x") and text[-1] == ">":
                cached = bytes([int(text[3:5], 16)])
            else:
                cached = text.replace(SPM_SPACE, " ").encode("utf-8")
            self._bytes_cache[id] = cached
        return cached

    def __repr__(self) -> str:
        return (f"HFTokenizer(vocab_size={self.vocab_size}, decoder={self.decoder_kind}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, add_bos={self.add_bos})")


def _token_content(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise FormatError(f"{where} must be a string or an object with 'content', got {value!r}")


def _id_list(value: Any, where: str, n_vocab: int) -> list[int]:
    values = value if isinstance(value, list) else [value]
    out = []
    for v in values:
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n_vocab:
            raise FormatError(f"{where} = {value!r}: not a token id of the vocabulary (size {n_vocab})")
        out.append(v)
    return out


def load_hf_tokenizer(directory: Path, config: Mapping[str, Any], tokenizer_config: Mapping[str, Any] | None,
                      generation_config: Mapping[str, Any] | None, n_model_vocab: int = 0) -> HFTokenizer:
    """The tokenizer of an HF folder (see the module docstring for where each piece comes from).

    ``n_model_vocab``: the rows of the model's output layer; ids from the tokenizer's size up to it are
    padding, accepted and decoded as nothing."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise FormatError(f"{path}: missing (minfer reads HF tokenizers from tokenizer.json)")
    try:
        backend = TokenizersTokenizer.from_file(str(path))
        spec = json.loads(path.read_text(encoding="utf-8"))
    except Exception as e:  # the Rust side's messages ("expected value at line 1 column 1", unknown variants...)
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise FormatError(f"{path}: not a valid tokenizer.json ({lines[0]})") from None
    tc = tokenizer_config or {}
    tc_path = directory / "tokenizer_config.json"
    n_vocab = backend.get_vocab_size(with_added_tokens=True)
    tokens = [backend.id_to_token(i) or "" for i in range(n_vocab)]

    def special_id(field: str, config_field: str) -> int | None:
        text = _token_content(tc.get(field), f"{tc_path}: {field}")
        if text is not None:
            i = backend.token_to_id(text)
            if i is None:
                raise FormatError(f"{tc_path}: {field} {text!r} is not a token of {path.name}")
            return i
        ids = _id_list(config.get(config_field), f"{directory / 'config.json'}: {config_field}", n_vocab)
        return ids[0] if ids else None

    bos_id = special_id("bos_token", "bos_token_id")
    eos_id = special_id("eos_token", "eos_token_id")
    with_special = backend.encode("x", add_special_tokens=True).ids
    plain = backend.encode("x", add_special_tokens=False).ids
    add_bos = tc.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = bos_id is not None and len(with_special) > len(plain) and with_special[0] == bos_id
    add_eos = tc.get("add_eos_token")
    if not isinstance(add_eos, bool):
        add_eos = eos_id is not None and len(with_special) > len(plain) and with_special[-1] == eos_id
    if add_bos and bos_id is None:
        raise FormatError(f"{tc_path}: add_bos_token is true but no bos_token is set")

    eog = set(_id_list(config.get("eos_token_id"), f"{directory / 'config.json'}: eos_token_id", n_vocab))
    if generation_config:
        eog |= set(_id_list(generation_config.get("eos_token_id"),
                            f"{directory / 'generation_config.json'}: eos_token_id", n_vocab))
    if eos_id is not None:
        eog.add(eos_id)
    eog |= {i for i, t in backend.get_added_tokens_decoder().items() if t.special and t.content in EOG_TEXTS}
    return HFTokenizer(backend, tokens, _decoder_kind(spec.get("decoder")), n_model_vocab, model="hf",
                       pre="tokenizer.json", bos_id=bos_id, eos_id=eos_id, eog_ids=frozenset(eog), add_bos=add_bos,
                       add_eos=add_eos)


def load_hf_chat_template(directory: Path, tokenizer_config: Mapping[str, Any] | None) -> ChatTemplate | None:
    """The folder's chat template with its BOS/EOS texts; None when it has none."""
    tc = tokenizer_config or {}
    where = directory / "tokenizer_config.json"
    source = tc.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
        source = named.get("default", next(iter(named.values()), None))
    if source is None:
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            try:
                source, where = jinja.read_text(encoding="utf-8"), jinja
            except UnicodeDecodeError as e:
                raise FormatError(f"{jinja}: not UTF-8 text (byte {e.start}: {e.reason})") from None
            except OSError as e:
                raise FormatError(f"{jinja}: cannot read it ({e.strerror or e})") from None
    if source is None or source == "":
        return None
    if not isinstance(source, str):
        raise FormatError(f"{where}: chat_template must be a string, got {type(source).__name__}")
    bos = _token_content(tc.get("bos_token"), f"{where}: bos_token") or ""
    eos = _token_content(tc.get("eos_token"), f"{where}: eos_token") or ""
    try:
        return ChatTemplate(source, bos_token=bos, eos_token=eos)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None


def generation_defaults(generation_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Sampling defaults from ``generation_config.json``: its temperature / top_k / top_p / min_p /
    repetition_penalty, taken only when it says ``do_sample: true`` (transformers otherwise decodes greedily
    and ignores them, while minfer keeps llama.cpp's sampling defaults). Explicit arguments override them."""
    g = generation_config or {}
    if g.get("do_sample") is not True:
        return {}
    fields = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
              "repetition_penalty": "repeat_penalty"}
    out: dict[str, Any] = {}
    for hf_name, ours in fields.items():
        value = g.get(hf_name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[ours] = value
    return out
