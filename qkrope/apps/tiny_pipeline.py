"""Tiny random diffusers pipelines built in code (nothing downloaded), one recipe per model
family, to try a family end to end and for the tests:

    python -m qkrope.apps.tiny_pipeline FAMILY DIR      # or save_tiny_pipeline(FAMILY, DIR)
    qkrope export --model transformer --diffusers DIR/transformer -o tiny.onnx
    qkrope generate DIR --transformer tiny.onnx --prompt "a cat" --steps 2 -o cat.png

:func:`save_tiny_pipeline` saves a whole pipeline folder with ``save_pretrained``
(model_index.json, a tiny random transformer, VAE, scheduler, and random text encoders with
tokenizers built in code), the pipeline class the family's diffusers checkpoints use. Each
family's recipe lives in its folder (``qkrope/families/<f>/tiny.py``: ``save_pipeline(record,
directory, seed)``), found through the registry (``qkrope.families.hooks(record, "tiny")``);
this module names no family. It holds what the recipes share: :func:`byte_tokenizer` (any
prompt tokenizes, one token per byte), :func:`randomised` (weights of a non-trivial scale) and
the latent bound the pipeline tests use.

The names of the Qwen-Image recipe that came first (``tiny_transformer``, ``tiny_vae``,
``TRANSFORMER_CONFIG``, ``pipeline``, ``prompt_embeds``, ...) are still read from here: they
live in the default family's ``tiny`` module (:func:`__getattr__`), and
:func:`save_text_pipeline` saves that family's pipeline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.errors import InputError, QkropeError


# The exported transformer's output differs from diffusers' by the fp32 summation orders of
# ONNX Runtime's and PyTorch's kernels, <= 1e-4 x max|output| (tests/test_transformer_export.py).
# A flow-matching Euler step adds (sigma_next - sigma) x output to the latents and the sigmas
# travel at most 1 in total, so the latents carry at most that error over all steps; true CFG
# combines two predictions as neg + s (pos - neg), amplifying an error by at most (1 + 2 s) before
# diffusers rescales it to the conditional prediction's norm. The predictions are of the latents'
# magnitude (unit-variance noise at the start), hence:
TRANSFORMER_PARITY = 1e-4


def latent_bound(reference: torch.Tensor, cfg_scale: float = 1.0,
                 parity: float = TRANSFORMER_PARITY) -> float:
    """Largest |latents - reference| an exported transformer whose per-call error is within
    ``parity`` x max|output| may cause (derivation above)."""
    return float(parity * (1 + 2 * max(cfg_scale, 1.0)) * reference.abs().max())


def randomised(model, seed: int = 0, *, scale: float = 0.2, vector_scale: float | None = 0.05,
               norms_near_one: bool = True):
    """``model`` with random weights of a non-trivial scale (diffusers' init zeroes some
    layers): matrices ~ N(0, scale^2), vectors ~ N(0, vector_scale^2) (None: ``scale``), norm
    weights near 1 (``norms_near_one``)."""
    vector_scale = scale if vector_scale is None else vector_scale
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (scale if p.dim() > 1 else vector_scale)
                    + (1.0 if norms_near_one and p.dim() == 1 and "norm" in name else 0.0))
    return model.eval()


#: A chat template in the ChatML form the Qwen-family prompt templates use (system / user /
#: assistant turns between <|im_start|> and <|im_end|>), for the pipelines that call
#: ``tokenizer.apply_chat_template``; keyword arguments it does not read are ignored.
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                   "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                   "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
                   "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

#: the special tokens of :func:`byte_tokenizer` by default: pad, the chat markers, end
BYTE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_tokenizer(specials=BYTE_SPECIALS, *, pad: str = "<|endoftext|>",
                   eos: str = "<|im_end|>", bos: str | None = None, unk: str | None = None,
                   model_max_length: int | None = None, chat_template: str | None = None,
                   append_eos: bool = False):
    """A byte-level BPE tokenizer without merges (one token per byte, plus ``specials``), built
    in code: any prompt tokenizes, nothing downloaded. ``append_eos`` ends every encoded text
    with ``eos`` (as T5's and CLIP's tokenizers do); ``model_max_length`` is the length
    ``truncation=True`` cuts to where a pipeline gives none."""
    require("transformers", "a tiny pipeline's tokenizer")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys([*specials, *(t for t in (pad, eos, bos, unk) if t)]))
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    if append_eos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {eos}", pair=f"$A $B {eos}", special_tokens=[(eos, vocab[eos])])
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, eos_token=eos,
                                  bos_token=bos, unk_token=unk, **extra)
    if chat_template is not None:
        out.chat_template = chat_template
    return out


def t5_encoder(tokenizer, width: int, seed: int = 0, *, umt5: bool = False):
    """A random 1-layer T5 (or UMT5) encoder of ``width`` over ``tokenizer``'s vocabulary."""
    require("transformers", "a tiny pipeline's T5 text encoder")
    import transformers

    config_cls, cls = ((transformers.UMT5Config, transformers.UMT5EncoderModel) if umt5
                       else (transformers.T5Config, transformers.T5EncoderModel))
    torch.manual_seed(seed)
    return cls(config_cls(vocab_size=len(tokenizer), d_model=width, d_kv=8, d_ff=32,
                          num_layers=1, num_heads=2, relative_attention_num_buckets=8,
                          pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=tokenizer.eos_token_id,
                          decoder_start_token_id=tokenizer.pad_token_id)).eval()


def clip_text_encoder(tokenizer, width: int, seed: int = 0):
    """A random 1-layer CLIPTextModel of ``width`` (its pooled output is ``width`` wide) over
    ``tokenizer``'s vocabulary, 77 positions; it pools at the tokenizer's end token."""
    require("transformers", "a tiny pipeline's CLIP text encoder")
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    return CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
        projection_dim=width, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id or tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id)).eval()


def decoder_encoder(config_cls, model_cls, tokenizer, width: int, layers: int = 1,
                    seed: int = 0, **config):
    """A random decoder-only language model used as a text encoder (Qwen2/Qwen3/Llama...):
    ``layers`` layers of ``width`` (2 heads) over ``tokenizer``'s vocabulary."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=32,
                    num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                    max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    settings.update(config)
    return model_cls(config_cls(**settings)).eval()


def save_transformer(model, directory: str | Path) -> Path:
    directory = Path(directory)
    model.save_pretrained(str(directory))
    return directory


def _record(family: str):
    """The registry's record of ``family`` (its sidecar name, e.g. ``flux1``); one line listing
    the known ones otherwise."""
    from qkrope import families

    if not isinstance(family, str) or family not in families.names():
        raise InputError(f"unknown model family {family!r}: the tiny pipelines are "
                         f"{', '.join(families.names())}. Fix: pass one of them")
    return families.by_name(family)


def save_tiny_pipeline(family: str, directory: str | Path, seed: int = 0) -> Path:
    """Save the tiny random pipeline of ``family`` (a name of :func:`qkrope.families.names`)
    to ``directory`` with ``save_pretrained``: a folder ``qkrope generate`` runs from a prompt.
    The folder is written under a temporary name and renamed into place, so an existing
    ``directory`` is never touched (one that holds files is refused)."""
    from qkrope import families

    record = _record(family)
    directory = Path(directory)
    if directory.is_symlink() or directory.exists() and (
            not directory.is_dir() or any(directory.iterdir())):
        raise InputError(f"{directory} already exists and is not an empty folder. Fix: pass a "
                         f"new folder for the tiny {record.short} pipeline (or remove it)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        families.hooks(record, "tiny").save_pipeline(record, staging, seed)
        if directory.is_dir():
            directory.rmdir()  # empty (checked above): the staged folder takes its place
        os.replace(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def save_text_pipeline(directory: str | Path, seed: int = 0) -> Path:
    """The tiny pipeline of the default family (Qwen-Image, the README's recipe):
    :func:`save_tiny_pipeline` of ``qkrope.families.default()``."""
    from qkrope import families

    return save_tiny_pipeline(families.default().name, directory, seed)


def __getattr__(name: str):
    """The default family's tiny builders by their old names here (``tiny_transformer``,
    ``TRANSFORMER_CONFIG``, ...): read from its ``tiny`` module."""
    if name.startswith("__"):
        raise AttributeError(name)
    from qkrope import families

    module = families.hooks(families.default(), "tiny")
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def main(argv: list[str] | None = None) -> int:
    from qkrope import families

    parser = argparse.ArgumentParser(
        prog="python -m qkrope.apps.tiny_pipeline",
        description="Save a tiny random diffusers pipeline of a model family (built in code, "
                    "nothing downloaded) with save_pretrained, to try the family end to end: "
                    "qkrope export --model transformer --diffusers DIR/transformer -o t.onnx; "
                    "qkrope generate DIR --transformer t.onnx --prompt 'a cat' -o cat.png. "
                    f"Families: {', '.join(families.names())}.")
    parser.add_argument("family", metavar="FAMILY",
                        help=f"one of {', '.join(families.names())}")
    parser.add_argument("directory", metavar="DIR", help="a new (or empty) folder to save to")
    parser.add_argument("--seed", type=int, default=0, help="random weights' seed (default 0)")
    args = parser.parse_args(argv)
    try:
        out = save_tiny_pipeline(args.family, args.directory, args.seed)
    except QkropeError as exc:
        print(f"qkrope tiny_pipeline: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


__all__ = ["save_tiny_pipeline", "save_text_pipeline", "byte_tokenizer", "randomised",
           "t5_encoder", "clip_text_encoder", "decoder_encoder",
           "latent_bound", "TRANSFORMER_PARITY", "CHATML_TEMPLATE", "save_transformer", "main"]

if __name__ == "__main__":
    sys.exit(main())
