"""Training checkpoints: one load and one save entry point, every format behind them.

    checkpoint_to_load(run) -> CheckpointInfo | None    find and check what --load names (load.py)
    load_checkpoint(info, trainer, config)              read it into the trainer (load.py)
    save_checkpoint(root, iteration, trainer)           write the run's --ckpt-format (save.py)
    CheckpointSaver                                     the training loop's saves, or --async-save (save.py)

Formats: ours (canonical.py: layout-independent pieces with file digests, RNG states and the data
position) and Megatron-LM's torch_dist (torch_dist.py, its recorded `args` in torch_dist_args.py).
Both share Megatron's directory layout (directory.py) and the trainer's state as pieces (state.py).
Hugging Face models (hugging_face.py: Llama and GPT-2 tensors <-> ours; hugging_face_files.py:
safetensors directories) are model-only: tools/checkpoint/convert.py converts them to and from
ours, as it converts between ours and torch_dist with the format modules directly.
"""

from megatron.training.checkpoint.directory import CheckpointInfo
from megatron.training.checkpoint.load import checkpoint_to_load, load_checkpoint
from megatron.training.checkpoint.save import CheckpointSaver, save_checkpoint

__all__ = ["CheckpointInfo", "CheckpointSaver", "checkpoint_to_load", "load_checkpoint", "save_checkpoint"]
