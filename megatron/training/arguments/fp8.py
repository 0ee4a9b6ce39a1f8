"""Megatron-LM's FP8 flags -> the Fp8Recipe (megatron/core/fp8/recipe.py) the model config carries.

Names, choices and defaults are Megatron-LM's (`--fp8-format` turns FP8 on; the recipe flags default to
megatron-core's TransformerConfig values). A recipe flag without --fp8-format is refused rather than
ignored; so are the recipes that cannot run here (mxfp8: Blackwell only; custom: a quantizer factory).
"""

from __future__ import annotations

import argparse

from megatron.core.fp8.recipe import AMAX_ALGOS, FORMATS, RECIPES, Fp8Recipe

REFUSED_RECIPES = {
    "mxfp8": "MXFP8 needs Blackwell tensor cores (compute capability 10.0); use blockwise or tensorwise",
    "custom": "custom quantizer factories (--fp8-quantizer-factory) are not built; use delayed, tensorwise, blockwise",
}
# flag -> (argparse destination, Megatron's default), the recipe flags that need --fp8-format
_RECIPE_FLAGS = {
    "--fp8-recipe": ("fp8_recipe", "delayed"),
    "--fp8-margin": ("fp8_margin", 0),
    "--fp8-amax-history-len": ("fp8_amax_history_len", 1),
    "--fp8-amax-compute-algo": ("fp8_amax_compute_algo", "most_recent"),
    "--no-fp8-wgrad": ("fp8_wgrad", True),
    "--tp-only-amax-red": ("tp_only_amax_red", False),
    "--first-last-layers-bf16": ("first_last_layers_bf16", False),
    "--num-layers-at-start-in-bf16": ("num_layers_at_start_in_bf16", 1),
    "--num-layers-at-end-in-bf16": ("num_layers_at_end_in_bf16", 1),
    "--fp8-param-gather": ("fp8_param_gather", False),
}


FP8_FLAGS = ("--fp8-format", *_RECIPE_FLAGS, "--disable-fp8-wgrad")  # the built flags (megatron_flags.py)


def add_fp8_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Defaults are None, so a flag given without --fp8-format is seen (Megatron's defaults: `_RECIPE_FLAGS`)."""
    g = parser.add_argument_group("fp8", "FP8 GEMMs in the transformer layers' linear layers (docs/fp8.md)")
    g.add_argument("--fp8-format", choices=FORMATS, help="e4m3: every tensor e4m3; hybrid: gradients in e5m2")
    g.add_argument("--fp8-recipe", choices=[*RECIPES, *REFUSED_RECIPES], help="default delayed")
    g.add_argument("--fp8-margin", type=int, help="delayed scaling: scale = fp8_max / amax / 2^margin (default 0)")
    g.add_argument("--fp8-amax-history-len", type=int, help="delayed scaling: amaxes kept (default 1)")
    g.add_argument("--fp8-amax-compute-algo", choices=AMAX_ALGOS, help="default most_recent")
    g.add_argument(
        "--no-fp8-wgrad",
        "--disable-fp8-wgrad",
        dest="fp8_wgrad",
        action="store_const",
        const=False,
        help="the weight-gradient GEMM in the model's precision",
    )
    g.add_argument(
        "--tp-only-amax-red",
        action="store_const",
        const=True,
        help="delayed scaling: reduce activation amaxes over tp x cp only, not dp",
    )
    g.add_argument(
        "--first-last-layers-bf16", action="store_const", const=True, help="keep the first and last layers out of FP8"
    )
    g.add_argument("--num-layers-at-start-in-bf16", type=int, help="with --first-last-layers-bf16 (default 1)")
    g.add_argument("--num-layers-at-end-in-bf16", type=int, help="with --first-last-layers-bf16 (default 1)")
    g.add_argument(
        "--fp8-param-gather",
        action="store_const",
        const=True,
        help="accepted with a sharded optimizer (noted: weights are gathered in their own dtype here)",
    )
    return parser


def fp8_recipe_from_args(args, parallel) -> Fp8Recipe | None:
    """The recipe, or None without --fp8-format. One ValueError line for anything invalid."""
    given = [flag for flag, (dest, _) in _RECIPE_FLAGS.items() if getattr(args, dest) is not None]
    if args.fp8_format is None:
        if given:
            raise ValueError(f"{given[0]} needs --fp8-format e4m3 or hybrid (FP8 is off without it)")
        return None
    values = {
        dest: default if getattr(args, dest) is None else getattr(args, dest)
        for dest, default in _RECIPE_FLAGS.values()
    }
    if values["fp8_recipe"] in REFUSED_RECIPES:
        raise ValueError(
            f"--fp8-recipe {values['fp8_recipe']} is not supported here: {REFUSED_RECIPES[values['fp8_recipe']]}"
        )
    if getattr(args, "moe_grouped_gemm", False):
        raise ValueError(
            "--fp8-format with --moe-grouped-gemm is not built: grouped experts run their GEMMs in BF16; "
            "drop --moe-grouped-gemm (the expert loop runs FP8) or --fp8-format"
        )
    if values["fp8_param_gather"] and parallel.ddp.sharding_strategy == "no_shard":
        raise ValueError(
            "--fp8-param-gather needs sharded parameters to gather: add --use-distributed-optimizer "
            "(or --use-megatron-fsdp with a sharding strategy)"
        )
    recipe = Fp8Recipe(
        format=args.fp8_format,
        recipe=values["fp8_recipe"],
        margin=values["fp8_margin"],
        amax_history_len=values["fp8_amax_history_len"],
        amax_compute_algo=values["fp8_amax_compute_algo"],
        wgrad=values["fp8_wgrad"],
        tp_only_amax_red=values["tp_only_amax_red"],
        first_last_layers_bf16=values["first_last_layers_bf16"],
        num_layers_at_start_in_bf16=values["num_layers_at_start_in_bf16"],
        num_layers_at_end_in_bf16=values["num_layers_at_end_in_bf16"],
        param_gather=values["fp8_param_gather"],
    )
    recipe.validate_layers(args.num_layers, parallel.pp)
    tokens = args.seq_length // parallel.cp * args.micro_batch_size
    if tokens % 16:
        raise ValueError(
            f"--fp8-format: the tokens of a microbatch per cp rank (--seq-length / cp x --micro-batch-size = {tokens}) "
            f"are a GEMM dimension and must be divisible by 16"
        )
    return recipe


def fp8_notes(recipe: Fp8Recipe | None) -> list[str]:
    if recipe is None or not recipe.param_gather:
        return []
    return [
        "> note: --fp8-param-gather: the distributed optimizer gathers the weights in their own dtype "
        "(the FP8 all-gather and FP8 weight copies are not built); the GEMMs still run in FP8"
    ]
