# Sourced by examples/*_slurm.sbatch: runs the job's training step and deals with how it ends.
#   source tools/slurm_step.sh
#   run_step srun --kill-on-bad-exit=1 ... CMD ARGS...    # returns the ranks' exit status
# - SIGTERM to the batch script (the time limit is near: --signal=B:TERM@<s>): passed on to the
#   step, whose ranks finish the iteration, save (--exit-signal-handler) and exit 0; then the job
#   requeues itself. (Preemption and `scontrol requeue` signal the ranks directly.)
# - A node of the job died: the surviving ranks exit within the heartbeat bound
#   (--heartbeat-timeout-seconds), but srun waits for the dead node until SLURM declares it DOWN
#   (SlurmdTimeout, 300 s by default). Once this node's tasks of the step have all been gone for
#   STEP_EXIT_GRACE seconds (10) while srun still runs, srun is killed.
# - The ranks failed (status not 0) after saving a checkpoint in $CKPT during this run: the job
#   requeues itself, at most MAX_REQUEUES times (3), and resumes from that checkpoint. A run that
#   failed before its first save (bad flags, a broken node at start) would most likely fail the
#   same way again: no requeue (SLURM's own requeue after a node failure still applies).
#   SLURM holds a requeued job ~2 min (Reason=BeginTime) before it starts it again;
#   `scontrol update JobId=<id> StartTime=now+2` skips the wait (not `now`: a credential issued in
#   the second the last one was revoked is refused and the job fails).

_step_tasks_here() {  # how many processes of step 0 of this job run on this node
  scontrol listpids "$SLURM_JOB_ID.0" 2>/dev/null | awk 'NR > 1' | wc -l
}

_saved_iteration() { cat "${CKPT:-/nonexistent}/latest_checkpointed_iteration.txt" 2>/dev/null; }

_requeue() {
  scontrol requeue "$SLURM_JOB_ID" 2>/dev/null || echo "> requeue of job $SLURM_JOB_ID refused" >&2
}

_on_term() {
  echo "> SIGTERM: ranks save and exit"
  kill -TERM "$_step" 2>/dev/null
  wait "$_step"
  _requeue   # a no-op when SLURM is requeuing the job already
  exit 0
}

run_step() {
  local seen=0 gone=0 status restarts=${SLURM_RESTART_COUNT:-0} saved
  saved=$(_saved_iteration)
  "$@" &
  _step=$!
  trap _on_term TERM
  while kill -0 "$_step" 2>/dev/null; do
    if [ "$(_step_tasks_here)" -gt 0 ]; then
      seen=1; gone=0
    elif [ "$seen" = 1 ]; then
      gone=$((gone + 1))
      if [ "$gone" -ge "${STEP_EXIT_GRACE:-10}" ]; then
        echo "> the ranks on $(hostname) exited ${gone} s ago but srun still waits (a node died?): ending it"
        kill -KILL "$_step" 2>/dev/null
      fi
    fi
    sleep 1
  done
  wait "$_step"
  status=$?
  trap - TERM
  echo "> job $SLURM_JOB_ID ranks exited with status $status"
  if [ "$status" -ne 0 ] && [ "$(_saved_iteration)" != "$saved" ] && [ "$restarts" -lt "${MAX_REQUEUES:-3}" ]; then
    echo "> ranks failed after saving iteration $(_saved_iteration): requeueing job $SLURM_JOB_ID" \
      "(restart $((restarts + 1)) of at most ${MAX_REQUEUES:-3})"
    _requeue
  elif [ "$status" -ne 0 ]; then
    echo "> ranks failed without a new checkpoint (or after ${MAX_REQUEUES:-3} requeues): not requeued"
  fi
  return "$status"
}

run_torchrun_step() {  # run_torchrun_step SCRIPT FLAGS...: one torchrun per node of the job, each
  # starting GPUS_PER_NODE ranks; their c10d rendezvous is on the first node. TORCHRUN_ARGS: more
  # torchrun flags (e.g. --max-restarts 1: a dead rank restarts the workers of every node).
  export GPUS_PER_NODE TORCHRUN_ARGS="${TORCHRUN_ARGS:-}"
  # A store per rendezvous round: torch (2.13) otherwise hands restarted workers the first round's
  # store, whose stale gloo/NCCL addresses make their process group fail to connect.
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
  export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
  run_step srun --kill-on-bad-exit=1 --ntasks="$SLURM_NNODES" --ntasks-per-node=1 bash -c \
    'exec "$PYTHON" -m torch.distributed.run --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE" \
       --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" \
       $TORCHRUN_ARGS "$@"' torchrun "$@"
}
