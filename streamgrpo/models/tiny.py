"""A tiny random Qwen2.5-VL / Qwen3-VL, with a tokenizer trained here, for tests and the CPU demo.

Nothing is downloaded: the byte-level BPE tokenizer is trained with the ``tokenizers`` library on a
small built-in corpus (chat template pieces, the demo questions, answer formats), the processor is
the real Qwen image + video processor with explicit pixel bounds, and the model is the real
transformers class with a small config (~0.6M parameters). The directory loads back with
``AutoProcessor.from_pretrained`` and ``AutoModelForImageTextToText.from_pretrained``.

Same seed, same bytes: training the tokenizer is deterministic and the weights come from a seeded
generator, saved with safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

from streamgrpo.config.recipes import hooks
from streamgrpo.config.schema import RECIPES
from streamgrpo.data.prompts import NO_THINK_INSTRUCTION, THINK_INSTRUCTION

ARCHS = ("qwen2_5_vl", "qwen3_vl")
SIZES = ("tiny", "3b", "7b", "8b")
# Qwen2.5-VL-3B/7B-Instruct's published configs (layer sizes only; random weights, our tokenizer's
# special-token ids): for GPU measurements at real size without downloading anything.
REAL_SIZES = {
    "3b": dict(text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2),
               vision=dict(out_hidden_size=2048), tie=True),
    "7b": dict(text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4),
               vision=dict(out_hidden_size=3584), tie=False),
}
# Qwen3-VL-8B-Instruct's published config (layer sizes only).
REAL_QWEN3_SIZES = {
    "8b": dict(text=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128),
               vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]), tie=False),
}
REAL_ARCH_SIZES = {"qwen2_5_vl": ("3b", "7b"), "qwen3_vl": ("8b",)}
_REAL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31])

# Special tokens of the Qwen chat/vision format, in Qwen's own order, then the reasoning tags.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>", "<reasoning>", "</reasoning>"]

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
_WORDS = (
    "What colour is the moving square shape in the video? Which direction does the shape move? "
    "left right up down Which video shows a red shape? In what percentage of the frames is the shape in the "
    "left half? Answer with the option letter. Output the thinking process in and the final answer in tags. "
    "You are a helpful assistant. system user assistant Picture Video seconds frame the a of is in to and "
    "Collision Pick up Rotate EF is % quality Good Excellent Let me think about it. I see The answer is "
    "First, second, third. Options: (A) (B) (C) (D) (1) (2) (3) (4) A B C D 0 1 2 3 4 5 6 7 8 9 . , ; : ? ! "
)


def _corpus() -> list[str]:
    """Chat/template pieces, the prompt instructions and the installed recipes' phrases (the demo's questions), repeated so that BPE
    gives their words single tokens (short prompts keep the CPU demo fast)."""
    phrases = [
        THINK_INSTRUCTION.format(think=t, answer="answer") for t in ("think", "reasoning")
    ] + [
        NO_THINK_INSTRUCTION.format(answer="answer"),
        *[phrase for _, phrases_of in hooks(RECIPES, "tokenizer_phrases") for phrase in phrases_of()],
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n",
        "<|im_end|>\n<|im_start|>assistant\n",
    ]
    lines = [_WORDS] * 4 + phrases * 20
    for i, c in enumerate(_COLOURS):
        lines.append(f"(A) {c} (B) {_COLOURS[(i + 1) % 8]} (C) {_COLOURS[(i + 2) % 8]} <answer>{'ABC'[i % 3]}</answer>")
        lines.append(f"<think>The square is {c}.</think> <answer>({'ABC'[i % 3]}) {c}</answer>")
    for n in range(0, 101, 7):
        lines.append(f"<answer>{n}</answer> {n}.5% <{n / 2:.1f} seconds>")
    return lines


def _train_tokenizer(vocab_size: int = 640):
    """Byte-level BPE trained on the built-in corpus; returns a transformers Qwen2 tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    # The same pre-tokenisation as Qwen2's tokenizer, so training and use split text identically.
    pattern = (
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    )
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    # tokenizers 0.23 serialises merges as pairs; Qwen2Tokenizer wants them as tuples.
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["model"]["merges"]]
    hf_tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    hf_tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    hf_tok.add_tokens(TAG_TOKENS)  # not special: they stay visible in decoded text
    hf_tok.eos_token = "<|im_end|>"
    hf_tok.pad_token = "<|endoftext|>"
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def _model_config(arch: str, tokenizer, size: str = "tiny"):
    vocab = len(tokenizer)
    vocab_padded = ((vocab + 63) // 64) * 64
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    text = dict(
        vocab_size=vocab_padded,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    if size != "tiny" and size not in REAL_ARCH_SIZES[arch]:
        raise ValueError(f"size {size!r} is not a real size of {arch} ({', '.join(REAL_ARCH_SIZES[arch])})")
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}
        vision = dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, window_size=56, out_hidden_size=128, fullatt_block_indexes=[1], tokens_per_second=2,
        )
        if size != "tiny":
            real = REAL_SIZES[size]
            text.update(real["text"], max_position_embeddings=128000)
            text["rope_parameters"]["mrope_section"] = [16, 24, 24]
            vision.update(_REAL_VISION, **real["vision"])
            common["tie_word_embeddings"] = real["tie"]
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
    if arch == "qwen3_vl":
        from transformers import Qwen3VLConfig

        text["head_dim"] = 32
        text["rope_parameters"] = {
            "rope_type": "default", "rope_theta": 5e6, "mrope_section": [6, 5, 5], "mrope_interleaved": True,
        }
        vision = dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=128, num_position_embeddings=64, deepstack_visual_indexes=[1],
        )
        if size != "tiny":
            real = REAL_QWEN3_SIZES[size]
            text.update(real["text"], max_position_embeddings=262144)
            text["rope_parameters"]["mrope_section"] = [24, 20, 20]
            vision.update(real["vision"])
            common["tie_word_embeddings"] = real["tie"]
        return Qwen3VLConfig(text_config=text, vision_config=vision, **common)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _processor(arch: str, tokenizer):
    """The real Qwen processor with explicit, small pixel bounds (never upsample tiny demo frames)."""
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

        factor = 28
        bounds = {"shortest_edge": 4 * factor * factor, "longest_edge": 256 * factor * factor}
        image = Qwen2VLImageProcessor(size=bounds, patch_size=14, merge_size=2, temporal_patch_size=2)
        video = Qwen2VLVideoProcessor(
            size=bounds, patch_size=14, merge_size=2, temporal_patch_size=2, cap_pixels_per_frame=False
        )
        return Qwen2_5_VLProcessor(image_processor=image, video_processor=video, tokenizer=tokenizer,
                                   chat_template=CHAT_TEMPLATE)
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    factor = 32
    bounds = {"shortest_edge": 4 * factor * factor, "longest_edge": 256 * factor * factor}
    image = Qwen2VLImageProcessor(size=bounds, patch_size=16, merge_size=2, temporal_patch_size=2,
                                  image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    video = Qwen3VLVideoProcessor(size=bounds, patch_size=16, merge_size=2, temporal_patch_size=2,
                                  cap_pixels_per_frame=False, do_sample_frames=False)
    return Qwen3VLProcessor(image_processor=image, video_processor=video, tokenizer=tokenizer,
                            chat_template=CHAT_TEMPLATE)


def write_config(out_dir: str | Path, arch: str = "qwen2_5_vl", size: str = "tiny") -> Path:
    """Only the ``config.json`` of :func:`build_tiny`'s model: enough for the memory plan and the
    placement check of a real size (``streamgrpo config memory``) without building any weight."""
    if arch not in ARCHS or size not in SIZES:
        raise ValueError(f"unknown arch/size {arch!r}/{size!r}; expected {ARCHS} and {SIZES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _model_config(arch, _train_tokenizer(), size).save_pretrained(out)
    return out


def build_tiny(out_dir: str | Path, arch: str = "qwen2_5_vl", seed: int = 0, size: str = "tiny",
               layers: int | None = None, vocab: int | None = None) -> Path:
    """Write a random ``arch`` model, its tokenizer and processor to ``out_dir``; return the path.

    ``size="tiny"`` (~0.6M parameters, float32, deterministic per seed) for tests and the demo;
    ``"3b"``/``"7b"``: Qwen2.5-VL's real layer sizes, ``"8b"``: Qwen3-VL's, in bfloat16, initialised on
    CUDA when there is one (GPU measurements at real size). ``layers``: that many decoder layers and
    vision blocks instead of the size's own (the real shapes of each layer, few of them: what a CPU
    can run at a real size). ``vocab``: that many embedding rows instead of the size's own, at least the
    tokenizer's padded to 64 (``0``: just that: small embeddings and LM head at the same layer shapes, the
    CPU proxy of benchmarks/bench_learner.py --proxy; a smaller model in host memory)."""
    import torch
    from transformers import AutoModelForImageTextToText

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    config = _model_config(arch, tokenizer, size)
    if layers is not None:
        config.text_config.num_hidden_layers = layers
        if getattr(config.text_config, "layer_types", None):
            config.text_config.layer_types = config.text_config.layer_types[:layers]
        config.vision_config.depth = layers
        if hasattr(config.vision_config, "deepstack_visual_indexes"):
            config.vision_config.deepstack_visual_indexes = [i for i in config.vision_config.deepstack_visual_indexes
                                                             if i < layers]
    if vocab is not None:
        config.text_config.vocab_size = max(int(vocab), ((len(tokenizer) + 63) // 64) * 64)
    state = torch.random.get_rng_state()
    device = "cuda" if size != "tiny" and torch.cuda.is_available() else "cpu"
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForImageTextToText.from_config(
                config, dtype=torch.float32 if size == "tiny" else torch.bfloat16)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.save_pretrained(out)
    _processor(arch, tokenizer).save_pretrained(out)
    return out


