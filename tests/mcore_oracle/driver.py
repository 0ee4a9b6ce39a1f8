"""megatron-core as an oracle: its GPTModel, optimizer and `dist_checkpointing` on CPU over gloo.

Runs only in the megatron-core virtual environment, where our package is not importable:
    .venv-mcore/bin/python -I tests/mcore_oracle/driver.py SPEC.json
SPEC (JSON): {"world": ranks, "port": a free port, "jobs": [job, ...]}, the jobs run one after the
other in the same processes. A job: {"tp": tensor-parallel size (the rest of the ranks are data
parallel), "model": our model args (TransformerConfig field names, as our checkpoints record them),
"make_vocab_size_divisible_by": n, "seed": s, "bf16": bf16 weights
(optional: the model in megatron-core's Float16Module, the optimizer with fp32 master weights, as
Megatron-LM's --bf16 runs it), "batch": file holding {"tokens": [b, s], "labels":
[b, s]}, "optimizer": {lr, min_lr, warmup_iters, decay_iters, weight_decay, clip_grad, ...},
"distributed_optimizer": bool (megatron-core's DistributedOptimizer, default false), "bucket_size": n
(elements per gradient bucket, as --overlap-grad-reduce --ddp-bucket-size n; default: one bucket),
"dp_split": bool (default false: every data-parallel rank trains on the whole batch; true: dp rank d on its
own rows, the d-th of dp equal parts, as Megatron-LM's data loader gives them, and `train` records the
loss averaged over dp as Megatron-LM reports it; `forward` and `grads` then see rank 0's rows), "ops": [...]}.
The ops run in order on every rank:
- {"op": "forward", "out": F}: rank 0 writes {"logits": [b, s, vocab], "loss": [b, s]} to F;
- {"op": "train", "iters": n, "out": F}: n optimizer steps on the batch; F gets losses, grad norms, lrs;
- {"op": "grads", "out": F}: one backward of the batch's mean loss, no step; rank 0 writes the
  gradients of the vocabulary tensors (gathered over tp, padding rows included) to F;
- {"op": "save", "root": D, "iteration": i, "sharding": form}: a Megatron-LM training checkpoint
  D/iter_NNNNNNN; with the distributed optimizer its state is in `form` ("dp_reshardable", Megatron-LM's
  default, or "fully_reshardable": `--dist-ckpt-optim-fully-reshardable`), as Megatron-LM saves it;
- {"op": "load", "root": D, "optimizer": bool}: load D's latest checkpoint (model, optionally the
  optimizer and scheduler) as Megatron-LM's --load does;
- {"op": "buffers", "out": F}: rank 0 writes its gradient buffers' layout: per buffer, each parameter's
  [name, start, stop, bucket] in the buffer and each bucket's [offset, numel, numel_unpadded];
- {"op": "load_state", "file": F}: the model's state dict from a torch.save file under megatron-core's names
  (those of our one-rank model with the local layer spec); nothing but `_extra_state` may be left out.
- {"op": "time_checkpoint", "root": D, "repeat": n, "out": F, "turns": T}: the slowest rank's seconds of
  "save" and "load" (with the optimizer) in each of n rounds, and the checkpoint's bytes, written to F (a
  benchmark). With "turns" (a directory, optional), the rounds alternate with another program's: the
  driver writes T/mcore_0 when ready and T/mcore_<i+1> after its round i, which waits for T/ours_<i>;
  a file T/stop ends the run.
A job's "moe" (optional): megatron-core TransformerConfig MoE keyword arguments; the model then has MoE layers
(local spec, SequentialMLP experts) and `train` updates the expert bias as its finalize_model_grads does; "ep"
(optional, default 1): the expert-parallel size (in parallel_state and the TransformerConfig, which marks the
experts' parameters expert-parallel: their own buffers and, with ep > 1, a second optimizer, as Megatron-LM
runs); "moe_args" (optional): the MoE arguments its checkpoints record (Megatron-LM's argparse names).
"""

import argparse
import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_patches  # noqa: E402,F401  (before any other megatron.core import)

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed.finalize_model_grads import (  # noqa: E402
    _update_router_expert_bias,
    reset_model_temporary_tensors,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"


def padded_vocab(spec: dict) -> int:
    multiple = spec["make_vocab_size_divisible_by"] * spec["tp"]
    return -(-spec["model"]["vocab_size"] // multiple) * multiple


def params_dtype(spec: dict) -> torch.dtype:
    return torch.bfloat16 if spec.get("bf16") else torch.float32


def build_model(spec: dict) -> GPTModel:
    """megatron-core's GPTModel with the local layer spec; in bf16, its parameters are bf16 (initialised
    in fp32 and rounded, as Megatron-LM's --bf16 does) and attention's softmax runs in the scores' dtype
    (Megatron-LM's default: no --attention-softmax-in-fp32)."""
    m = spec["model"]
    config = TransformerConfig(
        bf16=bool(spec.get("bf16")),
        params_dtype=params_dtype(spec),
        attention_softmax_in_fp32=not spec.get("bf16"),
        num_layers=m["num_layers"],
        hidden_size=m["hidden_size"],
        ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"],
        num_query_groups=m["num_query_groups"],
        kv_channels=m["kv_channels"],
        normalization=m["normalization"],
        layernorm_epsilon=m["norm_epsilon"],
        gated_linear_unit=m["swiglu"],
        activation_func=torch.nn.functional.silu if m["swiglu"] else torch.nn.functional.gelu,
        add_bias_linear=m["add_bias_linear"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m["init_method_std"],
        tensor_model_parallel_size=spec["tp"],
        expert_model_parallel_size=spec.get("ep", 1),  # marks the experts' parameters expert-parallel
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        **spec.get("moe", {}),
    )
    if config.num_moe_experts is None:
        layer_spec = get_gpt_layer_local_spec(normalization=m["normalization"])
    else:  # dense and MoE layers by --moe-layer-freq, local modules
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=m["normalization"])
    return GPTModel(
        config,
        layer_spec,
        vocab_size=padded_vocab(spec),
        max_sequence_length=m["max_position_embeddings"],
        parallel_output=True,
        share_embeddings_and_output_weights=not m["untie_embeddings_and_output_weights"],
        position_embedding_type=m["position_embedding_type"],
        rotary_base=int(m["rotary_base"]),
    )


def megatron_lm_args(spec: dict, iteration: int, consumed: int) -> argparse.Namespace:
    """The model and run arguments a Megatron-LM training checkpoint records (its argparse names)."""
    m, o = spec["model"], spec.get("optimizer", {})
    values = dict(
        num_layers=m["num_layers"],
        hidden_size=m["hidden_size"],
        ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"],
        group_query_attention=m["num_query_groups"] != m["num_attention_heads"],
        num_query_groups=m["num_query_groups"],
        kv_channels=m["kv_channels"],
        padded_vocab_size=padded_vocab(spec),
        vocab_size=m["vocab_size"],
        make_vocab_size_divisible_by=spec["make_vocab_size_divisible_by"],
        max_position_embeddings=m["max_position_embeddings"],
        seq_length=m["seq_length"],
        position_embedding_type=m["position_embedding_type"],
        rotary_base=int(m["rotary_base"]),
        rotary_percent=1.0,
        normalization=m["normalization"],
        norm_epsilon=m["norm_epsilon"],
        swiglu=m["swiglu"],
        add_bias_linear=m["add_bias_linear"],
        add_qkv_bias=m["add_bias_linear"],
        untie_embeddings_and_output_weights=m["untie_embeddings_and_output_weights"],
        qk_layernorm=False,
        num_experts=None,
        multi_latent_attention=False,
        squared_relu=False,
        apply_layernorm_1p=False,
        tensor_model_parallel_size=spec["tp"],
        pipeline_model_parallel_size=1,
        params_dtype=params_dtype(spec),
        bf16=bool(spec.get("bf16")),
        fp16=False,
        use_distributed_optimizer=spec.get("distributed_optimizer", False),
        data_parallel_size=dist.get_world_size() // spec["tp"],
        overlap_grad_reduce=spec.get("bucket_size") is not None,
        ddp_bucket_size=spec.get("bucket_size"),
        transformer_impl="local",
        iteration=iteration,
        consumed_train_samples=consumed,
        consumed_valid_samples=0,
        train_iters=o.get("train_iters"),
        lr=o.get("lr"),
        min_lr=o.get("min_lr"),
        global_batch_size=spec.get("global_batch_size"),
        ckpt_format="torch_dist",
        expert_model_parallel_size=spec.get("ep", 1),
    )
    return argparse.Namespace(**values | spec.get("moe_args", {}))


def content_metadata(sharding: str) -> dict:
    """What Megatron-LM's checkpointing passes to `sharded_state_dict` and records in common.pt."""
    return {"distrib_optim_sharding_type": sharding, "chained_optim_avoid_prefix": True}


class Oracle:
    def __init__(self, spec: dict):
        self.spec = spec
        torch.manual_seed(spec["seed"])
        model_parallel_cuda_manual_seed(spec["seed"])
        distributed = spec.get("distributed_optimizer", False)
        buckets = spec.get("bucket_size")
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=buckets is not None,
            bucket_size=buckets,
            use_distributed_optimizer=distributed,
        )
        model = build_model(spec)
        config, self.gpt = model.config, model
        if spec.get("bf16"):
            model = Float16Module(config, model)
        self.model = DistributedDataParallel(config, ddp, model)
        o = spec.get("optimizer", {})
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.get("lr", 1e-3),
                min_lr=o.get("min_lr", 0.0),
                weight_decay=o.get("weight_decay", 0.0),
                adam_beta1=o.get("beta1", 0.9),
                adam_beta2=o.get("beta2", 0.999),
                adam_eps=o.get("eps", 1e-8),
                clip_grad=o.get("clip_grad", 1.0),
                bf16=bool(spec.get("bf16")),
                params_dtype=params_dtype(spec),
                use_distributed_optimizer=distributed,
            ),
            [self.model],
        )
        gbs = spec.get("global_batch_size", 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=o.get("lr", 1e-3),
            min_lr=o.get("min_lr", 0.0),
            lr_warmup_steps=o.get("warmup_iters", 0) * gbs,
            lr_decay_steps=o.get("decay_iters", 1) * gbs,
            lr_decay_style=o.get("decay_style", "cosine"),
            start_wd=o.get("weight_decay", 0.0),
            end_wd=o.get("weight_decay", 0.0),
            wd_incr_steps=o.get("decay_iters", 1) * gbs,
            wd_incr_style="constant",
        )
        self.iteration, self.consumed = 0, 0
        batch = torch.load(spec["batch"])
        self.tokens, self.labels = batch["tokens"], batch["labels"]
        self.samples = self.tokens.shape[0]  # the global batch, whatever this rank trains on
        if spec.get("dp_split"):
            dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
            rows = slice(rank * self.samples // dp, (rank + 1) * self.samples // dp)
            self.tokens, self.labels = self.tokens[rows].contiguous(), self.labels[rows].contiguous()
        self.positions = torch.arange(self.tokens.shape[1]).expand_as(self.tokens)

    def loss(self) -> torch.Tensor:
        return self.model(self.tokens, self.positions, None, labels=self.labels)

    def load_state(self, file: str) -> None:
        missing, unexpected = self.model.module.load_state_dict(torch.load(file), strict=False)
        assert not unexpected and all("_extra_state" in k for k in missing), (missing, unexpected)

    def forward(self, out: str) -> None:
        self.model.eval()
        with torch.no_grad():
            local = self.model(self.tokens, self.positions, None)
            loss = self.loss()
        parts = [torch.empty_like(local) for _ in range(self.spec["tp"])]
        dist.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)[..., : self.spec["model"]["vocab_size"]]
        if dist.get_rank() == 0:
            torch.save({"logits": logits, "loss": loss}, out)
        dist.barrier()
        self.model.train()

    def train(self, iters: int, out: str) -> None:
        record = {"loss": [], "grad_norm": [], "lr": []}
        for _ in range(iters):
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            loss = self.loss().float().mean()
            loss.backward()
            self.model.finish_grad_sync()
            if self.model.config.moe_router_enable_expert_bias:
                _update_router_expert_bias([self.model], self.model.config)
                reset_model_temporary_tensors(self.model.config, [self.model])
            ok, grad_norm, _ = self.optimizer.step()
            assert ok
            record["lr"].append(self.optimizer.param_groups[0]["lr"])
            self.scheduler.step(increment=self.samples)
            self.iteration += 1
            self.consumed += self.samples
            if self.spec.get("dp_split"):
                loss = loss.detach().clone()
                dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
                loss /= parallel_state.get_data_parallel_world_size()
            record["loss"].append(loss.item())
            record["grad_norm"].append(float(grad_norm))
        if dist.get_rank() == 0:
            json.dump(record, open(out, "w"))

    def grads(self, out: str) -> None:
        self.model.zero_grad_buffer()
        self.loss().float().mean().backward()
        self.model.finish_grad_sync()
        params = dict(self.gpt.named_parameters())
        grads = {}
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if name in params:
                local = params[name].main_grad.contiguous()
                parts = [torch.empty_like(local) for _ in range(self.spec["tp"])]
                dist.all_gather(parts, local, group=parallel_state.get_tensor_model_parallel_group())
                grads[name] = torch.cat(parts)
        if dist.get_rank() == 0:
            torch.save(grads, out)
        self.model.zero_grad_buffer()
        dist.barrier()

    def sharded_state(self, optimizer: bool, loading: bool = False, sharding: str = "dp_reshardable") -> dict:
        """Model and optimizer as dist_checkpointing sees them; `loading` creates the optimizer's
        state first (a fresh optimizer has none to fill), as Megatron-LM's load does. `sharding`: the
        distributed optimizer's form, passed as Megatron-LM's checkpointing passes it."""
        model = self.model.module.sharded_state_dict()
        state = {"model": model}
        if optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model, is_loading=loading, metadata=content_metadata(sharding)
            )
        return state

    def save(self, root: str, iteration: int, sharding: str = "dp_reshardable") -> None:
        directory = os.path.join(root, f"iter_{iteration:07d}")
        if dist.get_rank() == 0:
            os.makedirs(directory, exist_ok=True)
        dist.barrier()
        state = self.sharded_state(optimizer=True, sharding=sharding)
        state.update(
            args=megatron_lm_args(self.spec, iteration, self.consumed),
            checkpoint_version=3.0,
            iteration=iteration,
            opt_param_scheduler=self.scheduler.state_dict(),
            num_floating_point_operations_so_far=0,
        )
        dist_checkpointing.save(state, directory, content_metadata=content_metadata(sharding))
        if dist.get_rank() == 0:
            open(os.path.join(root, TRACKER), "w").write(str(iteration))
        dist.barrier()

    def load(self, root: str, optimizer: bool) -> None:
        iteration = int(open(os.path.join(root, TRACKER)).read().strip())
        directory = os.path.join(root, f"iter_{iteration:07d}")
        inners = self.optimizer.chained_optimizers  # one; with experts, the expert parameters' second
        dummy = self.spec.get("distributed_optimizer", False) and not inners[0].optimizer.state
        if dummy:
            # torch's AdamW (no apex or Transformer Engine here) has no state before its first step, and
            # DistributedOptimizer.state_dict() needs its step count: megatron-core's own helper steps once
            # on zero gradients; the load below overwrites the values it set (the step: below)
            for inner in inners:
                inner._init_optimizer_states_with_dummy_values()
        saved = dist_checkpointing.load_content_metadata(directory) or {}  # Megatron-LM's load reads it first
        sharding = saved.get("distrib_optim_sharding_type", "fully_sharded_model_space")
        state = dist_checkpointing.load(self.sharded_state(optimizer, loading=True, sharding=sharding), directory)
        self.model.module.load_state_dict(state["model"])
        if optimizer:
            with torch.no_grad():  # fp32 weights: the dp_reshardable load copies into views of the parameters
                self.optimizer.load_state_dict(state["optimizer"])
            if self.spec.get("distributed_optimizer", False):
                # torch's AdamW counts steps per parameter: DistributedOptimizer.load_state_dict gives every
                # parameter one shared step tensor (AdamW would advance it once per parameter), and the
                # dp_reshardable load then copies the step of the optimizer being loaded into it (the dummy
                # step). Each parameter gets its own, the checkpoint's (its param groups', as fused Adam's).
                for inner in inners:
                    step = inner.optimizer.param_groups[0]["step"]
                    for param_state in inner.optimizer.state.values():
                        param_state["step"] = torch.tensor(float(step))
            self.scheduler.load_state_dict(state["opt_param_scheduler"])
            self.iteration = state["iteration"]
            self.consumed = state["args"].consumed_train_samples

    def buffers(self, out: str) -> None:
        names = {param: name for name, param in self.model.module.named_parameters()}
        layout = [
            {
                "params": [[names[p], *where] for p, where in buffer.param_index_map.items()],
                "buckets": [[b.offset, b.grad_data.numel(), b.numel_unpadded] for b in buffer.buckets],
            }
            for buffer in self.model.buffers + self.model.expert_parallel_buffers
        ]
        if dist.get_rank() == 0:
            os.makedirs(os.path.dirname(out), exist_ok=True)
            json.dump(layout, open(out, "w"))

    def time_checkpoint(self, root: str, repeat: int, out: str, turns: str | None = None) -> None:
        def timed(fn) -> float:
            dist.barrier()
            start = time.perf_counter()
            fn()
            seconds = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            return seconds.item()

        def turn(name: str) -> None:
            """Rank 0 writes T/<name> once every rank is done."""
            if turns is not None:
                dist.barrier()
                if dist.get_rank() == 0:
                    open(os.path.join(turns, name), "w").close()

        def wait(name: str) -> None:
            while turns is not None and not os.path.exists(os.path.join(turns, name)):
                if os.path.exists(os.path.join(turns, "stop")):
                    raise SystemExit("time_checkpoint: the other side stopped")
                time.sleep(0.01)

        times = {"save": [], "load": []}
        turn("mcore_0")
        for i in range(repeat):
            wait(f"ours_{i}")
            if dist.get_rank() == 0:
                shutil.rmtree(root, ignore_errors=True)
            times["save"].append(timed(lambda: self.save(root, 1)))
            times["load"].append(timed(lambda: self.load(root, optimizer=True)))
            turn(f"mcore_{i + 1}")
        if dist.get_rank() == 0:
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
            json.dump(times | {"bytes": size}, open(out, "w"))
        dist.barrier()


def run(rank: int, spec: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=spec["world"])
    for job in spec["jobs"]:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=job["tp"], expert_model_parallel_size=job.get("ep", 1)
        )
        oracle = Oracle(job)
        for op in job["ops"]:
            op = dict(op)
            getattr(oracle, op.pop("op"))(**op)
        dist.barrier()
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    torch.set_num_threads(1)
    mp.spawn(run, args=(spec,), nprocs=spec["world"], join=True)
