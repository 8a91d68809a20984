"""Tiny, seeded test checkpoints in Hugging Face layout, made with numpy and ``tokenizers`` only (no torch).

``make_test_checkpoint(kind, out_dir, dtype=..., seed=...)`` writes config.json, model.safetensors (or shards with
an index), generation_config.json, tokenizer.json and tokenizer_config.json (with a chat template):

* ``"dense"``  -- Llama: GQA (4 query / 2 KV heads), llama3 RoPE scaling (legacy ``rope_scaling`` spelling), a
                  sentencepiece-style BPE tokenizer with byte fallback and a Llama-2 ``[INST]`` chat template.
* ``"moe"``    -- Mixtral: 4 experts, top-2 routing, experts in the hub layout (``block_sparse_moe.experts.N.w1``),
                  same tokenizer family as dense.
* ``"hybrid"`` -- Qwen2: q/k/v biases, tied embeddings, ``use_sliding_window`` with a window of 8 tokens and
                  ``layer_types`` alternating sliding_attention / full_attention (Qwen2Model honours both in
                  transformers 5), a byte-level BPE tokenizer and a ChatML template.

``tokenizer="words"`` gives a dense or moe checkpoint a word-level vocabulary instead (whole lowercase English words
and ``. , ! ?``; anything else encodes as ``<unk>``): every token decodes to a readable word, so random weights still
say ordinary words (the local environment's models, pdstack/local/model.py).

Weights are drawn from ``numpy.random.default_rng(seed)`` with scales that give well-separated logits (so greedy
decoding is not decided by float rounding). The tokenizers are trained on a text generated here, deterministically.

About 400 lines, kept whole: one concern (a checkpoint the engine and vLLM both load), whose parts (tokenizers,
configs, weights, safetensors writer) nothing else uses.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

KINDS = ("dense", "moe", "hybrid")
TOKENIZERS = ("bpe", "byte-level", "words")  # the default: byte-level for hybrid, bpe (sentencepiece-style) otherwise
DTYPES = ("float32", "float16", "bfloat16")

_WORDS_TEXT = """
the a an one two three some many every small large quick slow bright dark red green blue old new
warm cold cat dog bird fish tree river mountain city road house garden window door book letter story
song machine server request token model layer cache window batch engine prefill decode stream region
network packet runs jumps reads writes sings sends builds moves waits opens closes finds keeps ships
loads serves answers over under near beside through across into from with without before after while
because and but or so quickly slowly quietly loudly today tomorrow yesterday here there always never
often sometimes café naïve résumé façade jalapeño über
"""
_WORDS = tuple(_WORDS_TEXT.split())

# The word-level tokenizer's vocabulary, in id order after its specials and punctuation; a vocab_size takes a prefix.
_VOCABULARY_TEXT = """
the a an in of to at on for by as be hello world how what who why which one two three four five some many every each
all both few more most other another this that these those
prefill decode datacenter cache link server request token model layer stream network packet gateway scheduler engine
batch queue region node cluster route key value memory disk signal answer question message reply record cat dog bird
fish horse cow sheep goat mouse bear wolf fox deer rabbit duck owl bee ant frog snake tree river mountain city road
house garden window door book letter story song machine field forest lake sea island valley hill bridge tower castle
village town street market school library museum church farm harbor beach desert cloud rain snow wind storm sun moon
star sky light shadow fire water stone sand bread cheese apple orange lemon honey milk tea coffee soup cake salt
sugar rice corn bean table chair bed lamp clock mirror cup plate knife spoon bottle basket box bag coat hat shoe
boot king queen child friend teacher doctor farmer sailor soldier painter writer singer driver baker guard traveler
mother father sister brother family neighbor stranger crowd people person voice face hand eye heart mind small large
quick slow bright dark red green blue yellow white black old new warm cold soft hard long short tall wide narrow
deep quiet loud happy sad calm busy early late near far high low clean empty full heavy young strong weak rich poor
simple strange gentle brave clever kind runs jumps reads writes sings sends builds moves waits opens closes finds
keeps ships loads serves answers walks talks sleeps dreams grows falls rises turns stops starts carries holds brings
takes gives makes sees hears feels knows thinks learns teaches calls asks tells shows follows leads watches helps
plays paints draws cooks eats drinks buys sells pays counts measures checks fixes breaks mends wakes rests over
under beside through across into from with without before after while during between behind above below around along
toward against beyond inside outside upon within because and but or so if when where then than though until unless
since quickly slowly quietly loudly gently softly carefully happily sadly easily freely often rarely today tomorrow
yesterday here there always never sometimes soon later now again once twice morning evening night noon day week
month year season spring summer autumn winter hour minute moment is was are were has had will can may might must
should would could he she it we they you me him her us them his its our their my your yes no not only just also even
still already almost perhaps very too quite first second third last next half whole north south east west left right
up down top bottom middle edge corner center side color shape size weight number line circle square point path
journey dream idea plan game gold silver iron glass wood paper cloth wool leather music dance picture poem word name
sound note page chapter time place country land earth ocean air space kitchen room hall floor wall roof stair
gate fence yard train ship boat plane car truck bicycle wagon café naïve über
"""
_VOCABULARY = tuple(_VOCABULARY_TEXT.split())
_PUNCTUATION = (".", ",", "!", "?")

_FIXED_LINES = (
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024.",
    "Punctuation (brackets) [square] {curly} <angle> 'quotes' \"double\" - dashes; colons: done.",
    "user: please answer briefly. assistant: sure, here is the answer.",
    "system: you are a helpful assistant that answers questions about caches.",
)

LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<<SYS>>\n{{ message['content'] }}\n<</SYS>>\n\n"
    "{% elif message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% elif message['role'] == 'assistant' %} {{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
)

CHATML_TEMPLATE = """{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def corpus(seed: int = 1234, lines: int = 400) -> str:
    """The training text: fixed lines plus seeded random sentences over a small vocabulary."""
    rnd = random.Random(seed)  # noqa: S311 - test data, not security
    out = list(_FIXED_LINES)
    for _ in range(lines):
        words = [rnd.choice(_WORDS) for _ in range(rnd.randint(4, 14))]
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rnd.choice([".", "!", "?", ",", ":"]))
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizers


def _sentencepiece_bpe(vocab_size: int) -> tuple[Tokenizer, dict[str, Any]]:
    """Llama-2 / Mistral style: metaspace "▁", BPE with byte fallback (<0x00>..<0xFF>), <s> prepended."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))  # noqa: S106
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    learned = vocab_size - len(specials) - len(byte_tokens)
    trainer = trainers.BpeTrainer(vocab_size=learned, special_tokens=[], show_progress=False)
    trainer_tok.train_from_iterator(corpus().splitlines(), trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab: dict[str, int] = {}
    for token in [*specials, *byte_tokens]:
        vocab[token] = len(vocab)
    for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if token not in vocab:
            vocab[token] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in trained["merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)  # noqa: S106
    )
    tok.add_special_tokens(specials)
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return _with_llama_specials(tok, vocab["<s>"])


def _with_llama_specials(tok: Tokenizer, bos_id: int) -> tuple[Tokenizer, dict[str, Any]]:
    """Llama's BOS before every sequence, and its special tokens and chat template in the tokenizer config."""
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "chat_template": LLAMA_CHAT_TEMPLATE,
    }
    return tok, config


def _byte_level_bpe(vocab_size: int) -> tuple[Tokenizer, dict[str, Any]]:
    """Qwen2 / GPT-2 style byte-level BPE with ChatML special tokens; no BOS."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus().splitlines(), trainer=trainer)
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHATML_TEMPLATE,
    }
    return tok, config


def _word_level(vocab_size: int) -> tuple[Tokenizer, dict[str, Any]]:
    """Whole words, Llama's specials and chat template: <unk> for any word or symbol outside the vocabulary."""
    specials = ["<unk>", "<s>", "</s>"]
    fixed = len(specials) + len(_PUNCTUATION)
    if not fixed < vocab_size <= fixed + len(_VOCABULARY):
        raise ValueError(f"a word-level vocab_size is {fixed + 1} to {fixed + len(_VOCABULARY)}, got {vocab_size}")
    words = vocab_size - fixed
    vocab = {token: i for i, token in enumerate([*specials, *_PUNCTUATION, *_VOCABULARY[:words]])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))  # noqa: S106
    tok.add_special_tokens(specials)
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # words and runs of punctuation
    # WordPiece's decoder puts a space between words and, with cleanup, none before . , ! ? (no "##" pieces here).
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return _with_llama_specials(tok, vocab["<s>"])


def _tokenizer(kind: str, name: str | None, vocab_size: int) -> tuple[Tokenizer, dict[str, Any]]:
    name = name or ("byte-level" if kind == "hybrid" else "bpe")
    if (name == "byte-level") != (kind == "hybrid"):
        raise ValueError(f"a {kind} checkpoint takes no {name} tokenizer: its config names that family's specials")
    if name == "words":
        return _word_level(vocab_size)
    if name == "bpe":
        return _sentencepiece_bpe(vocab_size)
    if name == "byte-level":
        return _byte_level_bpe(vocab_size)
    raise ValueError(f"unknown tokenizer {name!r}; expected one of {', '.join(TOKENIZERS)}")


# ---------------------------------------------------------------------------------------------------------------------
# Configs


def _base_config(kind: str) -> dict[str, Any]:
    common: dict[str, Any] = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "initializer_range": 0.02,
        "use_cache": True,
        "transformers_version": "5.24.0",
    }
    if kind == "dense":
        return {
            **common,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
    if kind == "moe":
        return {
            **common,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
    if kind == "hybrid":
        return {
            **common,
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 0,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "tie_word_embeddings": True,
        }
    raise ValueError(f"unknown test checkpoint kind {kind!r}; expected one of {', '.join(KINDS)}")


# ---------------------------------------------------------------------------------------------------------------------
# Weights


def _weights(cfg: Mapping[str, Any], rng: np.random.Generator) -> dict[str, npt.NDArray[np.float32]]:
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    d = cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    qwen = cfg["model_type"] == "qwen2"
    llama_bias = cfg["model_type"] == "llama" and cfg.get("attention_bias", False)
    mlp_bias = cfg["model_type"] == "llama" and cfg.get("mlp_bias", False)

    def lin(out_dim: int, in_dim: int, gain: float = 1.0) -> npt.NDArray[np.float32]:
        return (rng.standard_normal((out_dim, in_dim)) * (gain / float(np.sqrt(in_dim)))).astype(np.float32)

    def norm(n: int) -> npt.NDArray[np.float32]:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def bias(n: int) -> npt.NDArray[np.float32]:
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    # Tied embeddings double as the output projection: scale them so logits stay a few units wide.
    embed_std = 2.0 / np.sqrt(h) if cfg.get("tie_word_embeddings", False) else 1.0
    t: dict[str, npt.NDArray[np.float32]] = {
        "model.embed_tokens.weight": (rng.standard_normal((v, h)) * embed_std).astype(np.float32)
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        t[p + "self_attn.q_proj.weight"] = lin(q_out, h)
        t[p + "self_attn.k_proj.weight"] = lin(kv_out, h)
        t[p + "self_attn.v_proj.weight"] = lin(kv_out, h)
        t[p + "self_attn.o_proj.weight"] = lin(h, q_out)
        if qwen or llama_bias:
            t[p + "self_attn.q_proj.bias"] = bias(q_out)
            t[p + "self_attn.k_proj.bias"] = bias(kv_out)
            t[p + "self_attn.v_proj.bias"] = bias(kv_out)
        if llama_bias:
            t[p + "self_attn.o_proj.bias"] = bias(h)
        if cfg["model_type"] == "mixtral":
            moe = p + "block_sparse_moe."
            t[moe + "gate.weight"] = lin(cfg["num_local_experts"], h, gain=2.0)
            for e in range(cfg["num_local_experts"]):
                t[f"{moe}experts.{e}.w1.weight"] = lin(inter, h)
                t[f"{moe}experts.{e}.w3.weight"] = lin(inter, h)
                t[f"{moe}experts.{e}.w2.weight"] = lin(h, inter)
        else:
            t[p + "mlp.gate_proj.weight"] = lin(inter, h)
            t[p + "mlp.up_proj.weight"] = lin(inter, h)
            t[p + "mlp.down_proj.weight"] = lin(h, inter)
            if mlp_bias:
                t[p + "mlp.gate_proj.bias"] = bias(inter)
                t[p + "mlp.up_proj.bias"] = bias(inter)
                t[p + "mlp.down_proj.bias"] = bias(h)
    t["model.norm.weight"] = norm(h)
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = lin(v, h, gain=2.0)
    return t


def f32_to_bf16_bits(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """Round-to-nearest-even float32 -> bfloat16 bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    sixteen = np.uint64(16)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> sixteen) & np.uint64(1))) >> sixteen
    return rounded.astype(np.uint16)


_ST_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def write_safetensors(path: Path, tensors: Mapping[str, npt.NDArray[np.float32]], dtype: str) -> None:
    """Write float32 arrays as a safetensors file in ``dtype`` (numpy only, bf16 included)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        arr = tensors[name]
        if dtype == "bfloat16":
            data = f32_to_bf16_bits(arr).astype("<u2").tobytes()
        else:
            data = np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()
        header[name] = {
            "dtype": _ST_DTYPE[dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for blob in blobs:
            fh.write(blob)


def make_test_checkpoint(
    kind: str,
    out_dir: str | Path,
    dtype: str = "float32",
    *,
    seed: int = 0,
    overrides: Mapping[str, Any] | None = None,
    shards: int = 1,
    vocab_size: int = 500,
    tokenizer: str | None = None,
) -> Path:
    """Write a tiny HF checkpoint of ``kind`` ("dense", "moe", "hybrid") into ``out_dir`` and return its path.

    ``overrides`` are merged into config.json (e.g. another ``rope_scaling``, or bigger sizes for benchmarks; a
    ``vocab_size`` override larger than the tokenizer pads the embedding). ``shards`` > 1 splits the weights over
    several files with a ``model.safetensors.index.json``. ``tokenizer`` is one of TOKENIZERS ("words": dense and
    moe only), by default the kind's own. Same arguments, same bytes.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _base_config(kind)
    tok, tok_config = _tokenizer(kind, tokenizer, vocab_size)
    tok_vocab = tok.get_vocab_size(with_added_tokens=True)
    cfg["vocab_size"] = tok_vocab
    if kind == "hybrid":
        eot = tok.token_to_id("<|endoftext|>")
        cfg["bos_token_id"] = eot
        cfg["eos_token_id"] = eot
    cfg.update(dict(overrides or {}))
    if cfg["vocab_size"] < tok_vocab:
        raise ValueError(f"vocab_size {cfg['vocab_size']} is smaller than the tokenizer's {tok_vocab}")
    cfg["dtype"] = dtype

    tensors = _weights(cfg, np.random.default_rng(seed))
    if shards <= 1:
        write_safetensors(out / "model.safetensors", tensors, dtype)
    else:
        names = sorted(tensors)
        weight_map: dict[str, str] = {}
        for s in range(shards):
            part = names[s::shards]
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(out / file, {n: tensors[n] for n in part}, dtype)
            weight_map.update(dict.fromkeys(part, file))
        total = sum(
            int(np.prod(a.shape)) * np.dtype(dtype if dtype != "bfloat16" else "float16").itemsize
            for a in tensors.values()
        )
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    eos_ids: list[int] = [int(cfg["eos_token_id"])]
    if kind == "hybrid":
        im_end = tok.token_to_id("<|im_end|>")
        assert im_end is not None
        eos_ids.append(int(im_end))
    generation = {
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": eos_ids,
        "do_sample": False,
        "transformers_version": "5.24.0",
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        **{k: v for k, v in tok_config.items() if v is not None},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    return out
