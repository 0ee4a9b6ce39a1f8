"""Part offload, 1-3 as tables: correctness, bytes, overlap (from offload_check.run_configs)."""

from __future__ import annotations

from tools.gpu_check_lib.offload_check import CONFIGS, MIB, loss_tolerance, plain_copy_gbps, run_configs
from tools.gpu_check_lib.report import GIB, NA, gib


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and not isinstance(a, bool) and b else (a if a == NA else None)


def correctness(report, results: dict) -> None:
    section = report.section(
        "offload_correctness",
        "Offload correctness: losses vs the same run on the device",
        ["configuration", "compared with", "losses", "max relative difference", "tolerance", "verdict"],
    )
    for name, flags, reference in CONFIGS:
        result = results.get(name)
        if result is None:
            section.add(configuration=name, verdict="skipped: time budget")
            continue
        measured = result[2]
        row = dict(configuration=name, losses=", ".join(f"{x:.5f}" for x in measured.losses))
        if measured.error:
            section.add(**row, verdict=f"failed: {measured.error}")
            continue
        if reference is None:
            section.add(**row, **{"compared with": "-", "verdict": "reference"})
            continue
        ref = results.get(reference)
        if ref is None or ref[2].error or len(ref[2].losses) != len(measured.losses):
            section.add(**row, **{"compared with": reference, "verdict": "no reference"})
            continue
        diff = max(abs(a - b) / abs(b) for a, b in zip(measured.losses, ref[2].losses))
        tolerance = loss_tolerance(flags)
        verdict = "equal" if diff <= tolerance else "DIFFERS"
        section.add(
            **row,
            **{"compared with": reference, "max relative difference": diff, "tolerance": tolerance, "verdict": verdict},
        )
    section.notes.append(
        "tolerance: fp32, the relative loss tolerance of tests/parallel/test_host_chunks.py and "
        "test_offload_optimizer.py, over every iteration including the first; bf16 weights, 5e-5: the device's own "
        "noise floor (two AdamW implementations on one H200 disagree in more masters than the offloaded step: "
        "docs/gpu-check.md); the fp32 pair shows what the device's and the CPU's Adam arithmetic alone make of it"
    )


def bytes_table(report, ctx, results: dict) -> None:
    section = report.section(
        "offload_bytes",
        "Offload bytes: measured vs the estimator (GiB)",
        ["configuration", "chunks on host o/g/p", "device peak", "estimate certain", "estimate total",
         "peak / certain", "host slab", "estimate host", "slab / estimate", "pinned (torch allocator)",
         "VmPin + VmLck"],
    )  # fmt: skip
    for name, _, _ in CONFIGS:
        result = results.get(name)
        if result is None:
            section.add(configuration=name, **{"chunks on host o/g/p": "skipped: time budget"})
            continue
        _, estimate, measured = result
        extra = measured.extra
        slab = extra.get("slab")
        pinned = extra.get("pinned", (None, None))
        peak = measured.max_allocated
        section.add(
            configuration=name,
            **{
                "chunks on host o/g/p": extra.get("chunks", "0 (none)") if not measured.error else measured.error,
                "device peak": gib(peak),
                "estimate certain": estimate.certain / GIB,
                "estimate total": estimate.total / GIB,
                "peak / certain": _ratio(peak, estimate.certain),
                "host slab": gib(slab),
                "estimate host": estimate.host / GIB,
                "slab / estimate": _ratio(slab, estimate.host) if estimate.host else None,
                "pinned (torch allocator)": gib(pinned[0]),
                "VmPin + VmLck": gib(pinned[1]),
            },
        )
    section.notes.append(
        "device peak: torch.cuda.max_memory_allocated over the run; host slab: the runtime's one pinned slab "
        "(pinned in place with cudaHostRegister, so torch's pinned allocator does not count it; the kernel's "
        "VmPin/VmLck may or may not, by driver); estimate: pipeline rank 0 as the start-up check makes it "
        "(--offload-policy auto as full offload, its best case, as the check estimates it)"
    )
    for name, _, _ in CONFIGS:
        decision = results.get(name) and results[name][2].extra.get("decision")
        if decision:
            section.notes.append(f"{name}: {decision}")


def overlap(report, ctx, results: dict) -> None:
    section = report.section(
        "offload_overlap",
        "Offload overlap per timed iteration",
        ["configuration", "d2h MiB", "h2d MiB", "fetch wait ms", "grad add ms", "CPU step ms", "CPU step waited ms",
         "hidden", "copy ms", "achieved GB/s", "plain copy_ d2h/h2d GB/s", "achieved / plain", "step ms"],
    )  # fmt: skip
    for name, _, _ in CONFIGS:
        result = results.get(name)
        extra = result[2].extra if result else {}
        if "d2h" not in extra:
            continue  # nothing on host
        d2h, h2d, copy = extra["d2h"], extra["h2d"], extra["copy"]
        row = {"d2h MiB": d2h / MIB, "h2d MiB": h2d / MIB, "hidden": extra["hidden"]}
        row.update({"fetch wait ms": 1e3 * extra["fetch wait"], "grad add ms": 1e3 * extra["grad add"]})
        row.update({"CPU step ms": 1e3 * extra["cpu"], "CPU step waited ms": 1e3 * extra["exposed"]})
        if ctx.dry_run:  # times on CPU say nothing of a GPU's
            row.update({k: NA for k in ("hidden", "fetch wait ms", "grad add ms", "CPU step ms", "CPU step waited ms")})
            row.update({k: NA for k in ("copy ms", "achieved GB/s", "plain copy_ d2h/h2d GB/s", "achieved / plain")})
        else:
            plain = plain_copy_gbps(int(max(d2h, h2d)))
            plain_s = d2h / plain[0] / 1e9 + h2d / plain[1] / 1e9
            row.update({"copy ms": 1e3 * copy, "achieved GB/s": (d2h + h2d) / copy / 1e9 if copy else None})
            row["plain copy_ d2h/h2d GB/s"] = f"{plain[0]:.1f} / {plain[1]:.1f}"
            row["achieved / plain"] = plain_s / copy if copy else None
        step = result[2].step_s
        section.add(configuration=name, **row, **{"step ms": 1e3 * step if isinstance(step, float) else step})
    section.notes.append(
        "fetch wait: FetchStats.wait_seconds (host-resident parameter gathers); grad add: the training thread's time "
        "in HostChunks.add_into/settle; CPU step and waited: OffloadStats cpu/exposed seconds, hidden = 1 - waited / "
        "CPU step; copy: CUDA events around every Transfers.copy and parameter fetch; a dry run fills the bytes only "
        "(its copies are memcpy and its times a CPU's)"
    )


def check_offload(report, ctx) -> None:
    results = run_configs(ctx)
    correctness(report, results)
    bytes_table(report, ctx, results)
    overlap(report, ctx, results)
