"""Tokenizer and chat template of a Hugging Face checkpoint directory.

* ``tokenizer.json`` is loaded with the ``tokenizers`` library (no transformers at run time).
* ``tokenizer_config.json`` gives the special tokens and the ``chat_template`` (a ``chat_template.jinja`` file
  next to it wins, as in transformers >= 4.43). Named templates (a list of {name, template}) use "default".
* ``apply_chat_template`` renders like ``transformers.PreTrainedTokenizerBase.apply_chat_template``: a sandboxed
  jinja2 environment with trim_blocks/lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now``, a
  non-escaping ``tojson`` and a ``{% generation %}`` tag; the special tokens (``bos_token``, ``eos_token``, ...) are
  template variables; the rendered text is encoded without adding special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .errors import CheckpointError, EngineError

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(EngineError):
    """The chat template is missing, fails to compile, or raised while rendering."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat_template does not compile: {exc}") from exc


def _token_content(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        content = value.get("content")
        return None if content is None else str(content)
    return str(value)


def _normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain dicts without None values; reasoning under its standard name too (as transformers does)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"chat messages must be mappings, got {type(message).__name__}")
        plain = {k: v for k, v in message.items() if v is not None}
        for key in ("reasoning_content", "thinking", "reasoning"):
            if plain.get(key) is not None:
                reasoning = plain[key]
                plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
                break
        out.append(plain)
    return out


class Tokenizer:
    """Encode/decode text and render chats for one checkpoint."""

    def __init__(self, tokenizer: HFTokenizer, config: Mapping[str, Any], chat_template: str | None) -> None:
        self.backend = tokenizer
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            content = _token_content(config.get(key))
            if content is not None:
                self.special_tokens[key] = content
        self.chat_template = chat_template
        self._compiled: jinja2.Template | None = None

    @classmethod
    def from_directory(cls, directory: str | Path) -> Tokenizer:
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"tokenizer.json not found in {directory}")
        backend = HFTokenizer.from_file(str(path))
        config_path = directory / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return cls(backend, config, template if isinstance(template, str) else None)

    # -- tokens ----------------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    def special_token_id(self, key: str) -> int | None:
        """Id of a special token by role ("eos_token", "bos_token", ...), if the tokenizer declares it."""
        content = self.special_tokens.get(key)
        return None if content is None else self.token_to_id(content)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # -- chat ------------------------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` to the prompt text (``tokenize=False`` in transformers terms)."""
        if self.chat_template is None:
            raise ChatTemplateError("the checkpoint has no chat_template (tokenizer_config.json / chat_template.jinja)")
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty conversation")
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        variables: dict[str, Any] = {**self.special_tokens, **kwargs}
        try:
            return str(
                self._compiled.render(
                    messages=_normalise_messages(messages),
                    tools=None if tools is None else [dict(t) for t in tools],
                    documents=None if documents is None else [dict(d) for d in documents],
                    add_generation_prompt=add_generation_prompt,
                    **variables,
                )
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat_template failed: {exc}") from exc

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Render and encode a chat; special tokens come from the template only (none added by encoding)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)
