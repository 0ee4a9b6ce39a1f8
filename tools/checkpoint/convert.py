#!/usr/bin/env python
"""Convert models between Hugging Face, our checkpoints and Megatron-LM's.

    python tools/checkpoint/convert.py --loader hf --saver canonical --load-dir HF_DIR --save-dir OUT \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    python tools/checkpoint/convert.py --loader canonical --saver hf --load-dir OUT --save-dir HF_DIR
    python tools/checkpoint/convert.py --loader torch_dist --saver canonical --load-dir MEGATRON_LM_SAVE --save-dir OUT
    python tools/checkpoint/convert.py --loader canonical --saver torch_dist --load-dir OUT --save-dir MEGATRON_DIR \\
        --target-tensor-parallel-size 2

Formats: `hf` (Hugging Face Llama, Mistral-style GQA included, and GPT-2: safetensors +
config.json), `canonical` (ours: what --save writes by default), `torch_dist` (Megatron-LM's
sharded checkpoint, as Megatron-LM and `--ckpt-format torch_dist` write it). `mcore`, this
tool's old name for `canonical`, still works (it never meant Megatron-LM's format).
Canonical checkpoints are layout-independent, so the target sizes are only validated against
the model and appear in the printed command line. Vocabulary tensors: a Hugging Face export
holds the real vocabulary (`vocab_size` rows, Megatron's padding stripped); a canonical or
torch_dist save holds the rows Megatron pads to at the target tensor-parallel size
(--make-vocab-size-divisible-by x tp), the rows the source lacks drawn as Megatron initialises
padding (from --seed, normal with the model's init_method_std); a canonical save keeps any
further trained rows of the source, a torch_dist save drops them. Each is one note line. The
model only (no optimizer state),
in one process: from HF about one layer in memory at a time (tensors are read lazily and
written as they are converted), from and to torch_dist the whole model. The saved HF
directory loads with `AutoModelForCausalLM.from_pretrained`. Exit status 2 with one error
line on bad input.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from megatron.core.checkpointing import (  # noqa: E402
    CheckpointError,
    TensorPiece,
    read_pieces,
    saved_tensors,
    verify_files,
)
from megatron.core.checkpointing.megatron_lm import megatron_layout, our_tensors, to_megatron  # noqa: E402
from megatron.core.checkpointing.vocabulary import (  # noqa: E402
    VOCABULARY,
    is_vocabulary,
    resized_rows,
    rows_note,
    saved_vocab_rows,
)
from megatron.core.pipeline_parallel.layer_split import layers_per_rank  # noqa: E402
from megatron.core.tensor_parallel.initialization import InitSpec  # noqa: E402
from megatron.core.transformer.config import TransformerConfig  # noqa: E402
from megatron.core.transformer.model_fields import MODEL_FIELDS, model_record  # noqa: E402
from megatron.training.arguments.errors import EXPECTED_ERRORS, report_error  # noqa: E402
from megatron.training.checkpoint.canonical import commit_checkpoint, find_checkpoint  # noqa: E402
from megatron.training.checkpoint.directory import MEGATRON, detect_checkpoint_format  # noqa: E402
from megatron.training.checkpoint.hugging_face import GPT2, ConfigError  # noqa: E402
from megatron.training.checkpoint.hugging_face_families import family_of, family_of_args  # noqa: E402
from megatron.training.checkpoint.hugging_face_files import SafetensorsReader, read_json, write_hf_files  # noqa: E402
from megatron.training.checkpoint.torch_dist import (  # noqa: E402
    CHECKPOINT_VERSION,
    megatron_checkpoint_info,
    publish_megatron_checkpoint,
)
from megatron.training.checkpoint.torch_dist_args import config_fields, megatron_args  # noqa: E402

# HF tensors that carry no weights of their own (buffers, tied copies)
IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")


@dataclass(frozen=True)
class Target:
    """The layout a conversion is for: its sizes, and how it pads the vocabulary (rows the source
    lacks drawn from `seed`)."""

    tp: int = 1
    pp: int = 1
    make_vocab_size_divisible_by: int = 128
    seed: int = 1234

    def config(self, args: dict) -> TransformerConfig:
        """Our TransformerConfig for converted `args`; raises ValueError (one line) for a bad tp or pp."""
        config = TransformerConfig(
            **args, tensor_model_parallel_size=self.tp, make_vocab_size_divisible_by=self.make_vocab_size_divisible_by
        )
        layers_per_rank(config.num_layers, self.pp)
        return config


def padded_vocabulary(config: TransformerConfig, where: str, saved: int, seed: int, exact: bool):
    """A function (name, whole tensor) -> the tensor with the vocabulary rows of `config`'s layout
    (`saved`: the source's rows; `exact`: cut surplus trained rows too, else keep them), and a note
    line (None: nothing changes). Added rows are drawn as Megatron initialises padding."""
    rows = config.padded_vocab_size
    if saved == rows or (saved > rows and not exact):
        return (lambda name, tensor: tensor), None
    spec = InitSpec(
        (rows, config.hidden_size), kind=config.init_method, std=config.init_method_std, real_rows=config.vocab_size
    )

    def fit(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return resized_rows(tensor, rows, spec, seed, name) if is_vocabulary(name) else tensor

    return fit, rows_note(where, saved, rows, config.vocab_size)


def fit_vocabulary(tensors: dict, config: TransformerConfig, where: str, seed: int, exact: bool) -> dict:
    """`tensors` (our names -> whole tensors) with vocabulary tensors of `config`'s padded size (see
    `padded_vocabulary`); the note, if any, printed."""
    saved = saved_vocab_rows({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()})
    if saved is None:
        return tensors
    fit, note = padded_vocabulary(config, where, saved, seed, exact)
    if note:
        print(note, file=sys.stderr)
    return {name: fit(name, tensor) for name, tensor in tensors.items()}


def command_line(args: dict, target: Target, load: str) -> str:
    """The pretrain command (script and every recorded model flag) that runs the converted model."""
    llama_like = (
        args["swiglu"]
        and not args["add_bias_linear"]
        and args["untie_embeddings_and_output_weights"]
        and args["normalization"] == "RMSNorm"
        and args["position_embedding_type"] == "rope"
    )
    flags = []
    for field in MODEL_FIELDS:
        if field.name in args and field.applies(args):
            flags += field.command_line(args[field.name])
    if args["num_query_groups"] != args["num_attention_heads"]:
        flags.insert(flags.index("--num-query-groups"), "--group-query-attention")
    else:
        at = flags.index("--num-query-groups")
        del flags[at : at + 2]
    flags += [
        "--attention-dropout",
        f"{args['attention_dropout']}",
        "--hidden-dropout",
        f"{args['hidden_dropout']}",
        "--make-vocab-size-divisible-by",
        str(target.make_vocab_size_divisible_by),
        "--tensor-model-parallel-size",
        str(target.tp),
        "--pipeline-model-parallel-size",
        str(target.pp),
        "--load",
        load,
        "--finetune",
    ]
    return f"pretrain_{'llama' if llama_like else 'gpt'}.py " + " ".join(flags)


def _hf_prefix(family, reader: SafetensorsReader) -> str:
    """GPT-2 files hold `transformer.h.0...` (GPT2LMHeadModel) or `h.0...` (GPT2Model)."""
    return "transformer." if family is GPT2 and "transformer.wte.weight" in reader else ""


def _lazy_piece(rule, reader: SafetensorsReader, progress, fit) -> TensorPiece:
    """A piece whose tensor is read and converted (`fit`: name, tensor -> the vocabulary rows the
    target has) only when DCP writes it."""
    inputs = [torch.empty(reader.shape(n), dtype=reader.dtype(n), device="meta") for n in rule.hf]
    shape = tuple(fit(rule.ours, rule.to_ours(*inputs)).shape)

    def produce():
        progress.update(1)
        return fit(rule.ours, rule.to_ours(*(reader.get(n) for n in rule.hf)))

    return TensorPiece(rule.ours, shape, (0,) * len(shape), shape, inputs[0].dtype, produce)


def hf_to_canonical(load_dir: str, save_dir: str, target: Target) -> str:
    """Convert; returns the pretrain command line for the result."""
    cfg = read_json(os.path.join(load_dir, "config.json"))
    family = family_of(cfg)
    args = family.model_args(cfg)
    config = target.config(args)
    note = getattr(family, "approximation_note", lambda c: None)(cfg)
    if note:
        print(note, file=sys.stderr)
    reader = SafetensorsReader(load_dir)
    rules = family.rules(args, _hf_prefix(family, reader))
    used = {n for rule in rules for n in rule.hf}
    unmapped = [n for n in reader.names() if n not in used and not IGNORED.search(n) and n != "lm_head.weight"]
    if unmapped:
        raise ConfigError(f"{load_dir}: {len(unmapped)} tensors have no mapping, e.g. {unmapped[0]}")
    fit, note = padded_vocabulary(config, load_dir, config.vocab_size, target.seed, exact=False)
    if note:
        print(note, file=sys.stderr)
    with tqdm(total=len(rules), desc="hf -> canonical", unit="tensor") as progress:
        pieces = [_lazy_piece(rule, reader, progress, fit) for rule in rules]
        commit_checkpoint(
            save_dir,
            0,
            pieces,
            {
                "consumed_samples": 0,
                "model": model_record(config),
                "layout": None,
                "contents": ["model"],
                "source": load_dir,
            },
        )
    return command_line(args, target, save_dir)


def _layer_of(name: str) -> int:
    """Group of a canonical tensor for writing: -1 embeddings, layer index, or a large number for the rest."""
    if name.startswith("embedding."):
        return -1
    match = re.match(r"decoder\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else 1 << 30


@dataclass
class Source:
    """A checkpoint's model: our model args, our canonical tensors' (shape, dtype), and a reader of
    some of them (name -> tensor)."""

    args: dict
    saved: dict
    read: Callable[[list[str]], dict]


def canonical_source(load_dir: str) -> Source:
    info = find_checkpoint(load_dir)
    if info is None:
        raise CheckpointError(f"{load_dir}: no checkpoint (no latest_checkpointed_iteration.txt)")
    verify_files(info.directory, info.metadata["files"])
    saved = saved_tensors(info.directory)

    def read(names):
        tensors = {name: torch.empty(saved[name][0], dtype=saved[name][1]) for name in names}
        read_pieces([TensorPiece.whole(name, t) for name, t in tensors.items()], info.directory)
        return tensors

    return Source(info.metadata["model"], saved, read)


def torch_dist_source(load_dir: str) -> Source:
    """A Megatron-LM torch_dist checkpoint's model, under our canonical names."""
    if detect_checkpoint_format(load_dir) != MEGATRON:
        raise CheckpointError(f"{load_dir}: no Megatron-LM torch_dist checkpoint (its tracker and metadata.json)")
    info = megatron_checkpoint_info(load_dir)
    config = TransformerConfig(**config_fields(info.metadata["megatron_args"]))
    saved = {
        ours: (shape, dtype)
        for name, (shape, dtype) in saved_tensors(info.directory).items()
        if not name.startswith("optimizer.")
        for ours, shape in our_tensors(name, shape)
    }

    layout = megatron_layout(config)

    def read(names):
        tensors = {name: torch.empty(saved[name][0], dtype=saved[name][1]) for name in names}
        read_pieces(
            [to_megatron(TensorPiece.whole(name, t), layout) for name, t in tensors.items()],
            info.directory,
        )
        return tensors

    dropout = {"attention_dropout": config.attention_dropout, "hidden_dropout": config.hidden_dropout}
    return Source(model_record(config) | dropout, saved, read)


def hf_source(load_dir: str) -> Source:
    """A Hugging Face model under our canonical names (each tensor converted when read)."""
    cfg = read_json(os.path.join(load_dir, "config.json"))
    family = family_of(cfg)
    args = family.model_args(cfg)
    reader = SafetensorsReader(load_dir)
    rules = {rule.ours: rule for rule in family.rules(args, _hf_prefix(family, reader))}

    def shape(rule):
        return tuple(rule.to_ours(*(torch.empty(reader.shape(n), device="meta") for n in rule.hf)).shape)

    saved = {name: (shape(rule), reader.dtype(rule.hf[0])) for name, rule in rules.items()}

    def read(names):
        return {n: rules[n].to_ours(*(reader.get(h) for h in rules[n].hf)) for n in names}

    return Source(args, saved, read)


SOURCES = {"canonical": canonical_source, "torch_dist": torch_dist_source, "hf": hf_source}


def to_hf(source: Source, save_dir: str) -> None:
    args = source.args
    family = family_of_args(args)
    saved_dtype = source.saved["embedding.word_embeddings.weight"][1]
    hf_config = family.hf_config(args, str(saved_dtype).removeprefix("torch."))
    rules = family.rules(args)
    missing = [rule.ours for rule in rules if rule.ours not in source.saved]
    if missing:
        raise CheckpointError(f"no tensor {missing[0]} in the checkpoint (its model args need it)")
    exported = {rule.ours for rule in rules}
    unused = sorted(n for n in source.saved if not n.startswith(("optimizer.", "rng.")) and n not in exported)
    if unused:
        raise CheckpointError(
            f"{len(unused)} saved model tensors have no place in the {family.name} export, "
            f"e.g. {unused[0]} (the checkpoint's record lacks a model flag)"
        )
    groups = {}
    for rule in rules:
        groups.setdefault(_layer_of(rule.ours), []).append(rule)

    vocab_size = args["vocab_size"]
    saved = saved_vocab_rows(source.saved)
    if saved is not None and saved > vocab_size:
        print(
            f"> note: vocabulary rows {vocab_size}..{saved - 1} (Megatron's padding) not exported: "
            f"transformers' model holds vocab_size {vocab_size} rows",
            file=sys.stderr,
        )

    def reader(group_rules):
        def read() -> dict:
            tensors = source.read([r.ours for r in group_rules])
            real = {n: t[:vocab_size] if n in VOCABULARY else t for n, t in tensors.items()}
            return {n: t for r in group_rules for n, t in zip(r.hf, r.to_hf(real[r.ours]))}

        return read

    with tqdm(total=len(groups), desc="-> hf", unit="file") as progress:
        write_hf_files(save_dir, [reader(groups[key]) for key in sorted(groups)], hf_config, progress)


def to_canonical(source: Source, save_dir: str, target: Target, where: str) -> str:
    """Write the source's model as our checkpoint; returns the pretrain command line for it."""
    config = target.config(source.args)
    tensors = fit_vocabulary(source.read(sorted(source.saved)), config, where, target.seed, exact=False)
    pieces = [TensorPiece.whole(name, t) for name, t in tensors.items()]
    commit_checkpoint(
        save_dir,
        0,
        pieces,
        {"consumed_samples": 0, "model": model_record(config), "layout": None, "contents": ["model"]},
    )
    return command_line(source.args, target, save_dir)


def to_torch_dist(source: Source, save_dir: str, target: Target, where: str) -> None:
    """Write the source's model as Megatron-LM's torch_dist checkpoint (iteration 0, no optimizer
    state: Megatron-LM continues from it with --finetune or --no-load-optim --no-load-rng)."""
    config = target.config(source.args)
    if config.num_moe_experts is not None:
        raise ConfigError("--saver torch_dist of an MoE model: Megatron-LM's expert tensors are not mapped yet")
    tensors = fit_vocabulary(source.read(sorted(source.saved)), config, where, target.seed, exact=True)
    common = {
        "args": megatron_args(config, iteration=0, consumed_samples=0, tp=target.tp, pp=target.pp, extra={}),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0,
    }
    publish_megatron_checkpoint(save_dir, 0, [TensorPiece.whole(n, t) for n, t in tensors.items()], config, common)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    formats = ["hf", "canonical", "torch_dist", "mcore"]
    parser.add_argument(
        "--loader",
        choices=formats,
        required=True,
        help="hf: Hugging Face; canonical: ours; torch_dist: Megatron-LM's; mcore: canonical's old name",
    )
    parser.add_argument("--saver", choices=formats, required=True, help="as --loader")
    parser.add_argument("--load-dir", required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1)
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    parser.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="the target pads the vocabulary to a multiple of this x its tp (Megatron's flag)",
    )
    parser.add_argument(
        "--seed", type=int, default=1234, help="draws vocabulary padding rows the source lacks (Megatron's default)"
    )
    args = parser.parse_args(argv)
    for flag in ("loader", "saver"):
        if getattr(args, flag) == "mcore":
            print(
                f"note: --{flag} mcore is the old name of canonical (our format, not Megatron-LM's torch_dist)",
                file=sys.stderr,
            )
            setattr(args, flag, "canonical")
    if args.loader == args.saver:
        parser.error(f"--loader and --saver are both {args.loader}: nothing to convert")
    for flag in ("target_tensor_parallel_size", "target_pipeline_parallel_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process on purpose
    try:
        target = Target(
            args.target_tensor_parallel_size,
            args.target_pipeline_parallel_size,
            args.make_vocab_size_divisible_by,
            args.seed,
        )
        if args.loader == "hf" and args.saver == "canonical":  # lazily, a layer at a time
            line = hf_to_canonical(args.load_dir, args.save_dir, target)
            print(f"saved {args.save_dir}; train or evaluate it with:\n  {line}")
            return 0
        source = SOURCES[args.loader](args.load_dir)
        if args.saver == "hf":
            to_hf(source, args.save_dir)
            print(f"saved {args.save_dir} (loads with transformers' AutoModelForCausalLM.from_pretrained)")
        elif args.saver == "canonical":
            line = to_canonical(source, args.save_dir, target, args.load_dir)
            print(f"saved {args.save_dir}; train or evaluate it with:\n  {line}")
        else:
            to_torch_dist(source, args.save_dir, target, args.load_dir)
            print(
                f"saved {args.save_dir} (Megatron-LM loads it with --ckpt-format torch_dist --finetune, at "
                f"--tensor-model-parallel-size {target.tp} --make-vocab-size-divisible-by "
                f"{target.make_vocab_size_divisible_by})"
            )
    except EXPECTED_ERRORS as error:
        return report_error(error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
